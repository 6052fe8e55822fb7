"""What the iteration boundary captures besides gradients: RNG states, hyper-parameters, and the
state of the scheduler and of user objects, as immutable copies."""
from __future__ import annotations

import copy
import random

import numpy as np
import torch


def capture_rng() -> dict:
    """Python, numpy, torch CPU and (when initialized) CUDA generator states."""
    legacy = np.random.get_state(legacy=True)
    # numpy types it as dict | tuple; the global generator is MT19937, whose legacy state is the tuple.
    assert isinstance(legacy, tuple), "numpy's global generator is not MT19937"
    name, keys, pos, has_gauss, gauss = legacy
    version, internal, python_gauss = random.getstate()
    state = {
        # Its 625 ints as a tensor: raw bytes in a record, not 625 JSON numbers to encode each step.
        "python": (version, torch.from_numpy(np.fromiter(internal, np.int64, len(internal))), python_gauss),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def restore_rng(state: dict) -> None:
    random.setstate(_as_python_state(state["python"]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"].clone())  # needs its own storage
    if "cuda" in state and torch.cuda.is_available():
        for i, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, i)


def _as_python_state(state):
    """``random.setstate``'s argument from a captured state: its internal state as a tensor, or
    (files written before that) as a list or tuple of ints."""
    version, internal, gauss = state
    return version, python_internal(internal), gauss


def python_internal(internal) -> tuple:
    """The 625 ints of Python's generator state as the tuple ``random.getstate()`` holds."""
    return tuple(internal.tolist() if isinstance(internal, torch.Tensor) else internal)


def hyperparameters(param_groups) -> list:
    """Everything of each param group except its parameters (lr, betas, weight decay, ...)."""
    return [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
             for k, v in group.items() if k != "params"} for group in param_groups]


def apply_hyperparameters(param_groups, values: list) -> None:
    if len(values) != len(param_groups):
        raise ValueError(f"recorded {len(values)} param groups, optimizer has {len(param_groups)}")
    for group, stored in zip(param_groups, values):
        for key, value in stored.items():
            current = group.get(key)
            if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                current.copy_(value)  # keep tensor identity (fused/capturable optimizers hold it)
            else:
                group[key] = value


def state_dict_copy(obj) -> dict:
    """A deep copy of ``obj.state_dict()`` (safe to serialize later, in another thread)."""
    return copy.deepcopy(obj.state_dict())


def state_dicts(objects: dict) -> dict:
    """``state_dict_copy`` of each named object."""
    return {name: state_dict_copy(obj) for name, obj in objects.items()}


def load_state_dicts(objects: dict, states: dict, where: str) -> None:
    missing = set(objects) - set(states)
    if missing:
        raise ValueError(f"{where} holds no state for extra_state {sorted(missing)}; it has {sorted(states)}")
    for name, obj in objects.items():
        obj.load_state_dict(states[name])


def persistent_buffer_names(model: torch.nn.Module) -> set:
    """Names of the buffers that are part of ``model.state_dict()`` (computed once per model)."""
    persistent = set(model.state_dict(keep_vars=True))
    return {name for name, _ in model.named_buffers() if name in persistent}


def module_buffers(model: torch.nn.Module, names: set) -> dict:
    """Copies of the buffers ``names`` of ``model`` (BatchNorm statistics and the like)."""
    if not names:
        return {}   # no walk over the modules every step for a model without buffers
    return {name: buf.detach().clone() for name, buf in model.named_buffers() if name in names}


def restore_buffers(model: torch.nn.Module, buffers: dict) -> None:
    own = dict(model.named_buffers())
    for name, value in buffers.items():
        if name in own:
            with torch.no_grad():
                own[name].copy_(value)


def trained_elsewhere(model: torch.nn.Module, optimizer) -> frozenset:
    """Keys of ``model.state_dict()`` that are parameters being trained (``requires_grad``) but not
    by ``optimizer``: another optimizer's, when several optimizers train one model, each wrapped
    with all of it. A wrap neither saves nor restores them, so each directory holds its own
    optimizer's parameters and resuming one never overwrites what another restored."""
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return frozenset(key for key, value in model.state_dict(keep_vars=True).items()
                     if isinstance(value, torch.nn.Parameter) and value.requires_grad and id(value) not in mine)


def owned_model_state(model: torch.nn.Module, foreign: frozenset) -> dict:
    """``model.state_dict()`` without the ``foreign`` keys (see trained_elsewhere)."""
    state = model.state_dict()
    return {key: value for key, value in state.items() if key not in foreign} if foreign else state
