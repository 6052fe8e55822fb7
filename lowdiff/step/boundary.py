"""What the iteration boundary captures besides gradients: RNG states, hyper-parameters, and the
state of the scheduler and of user objects, as immutable copies."""
from __future__ import annotations

import array
import copy
import ctypes
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
        "python": (version, _python_words(internal), python_gauss),
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


# array("L") converts a tuple of ints at about twice np.fromiter's speed; where its items are 8
# bytes (Linux, macOS) their bits are the int64 values (each word is below 2**32).
_WORDS = "L" if array.array("L").itemsize == 8 else "q"


def _python_words(internal: tuple) -> torch.Tensor:
    return torch.frombuffer(array.array(_WORDS, internal), dtype=torch.int64)


def python_state_matches(captured) -> bool:
    """Whether Python's generator is in the state ``captured`` (capture_rng's "python" entry)."""
    version, internal, gauss = random.getstate()
    words = captured[1]
    if not isinstance(words, torch.Tensor):   # files written before the tensor form
        return (version, internal, gauss) == _as_python_state(captured)
    return (version == captured[0] and gauss == captured[2]
            and array.array(_WORDS, internal).tobytes() == words.numpy().tobytes())


def numpy_state_matches(captured) -> bool:
    """Whether numpy's global generator (MT19937) holds the key and position of ``captured``
    (capture_rng's "numpy" entry). Not its cached Gaussian: this serves the between-steps
    warning, where np.random.get_state (a Python-level copy of 624 words, about 30 µs) is too
    slow to call at every forward pass; the MT19937 state is read from its ctypes address."""
    _, keys, pos, _, _ = captured
    raw = _mt19937_state()
    live = _key_and_position(raw) if raw is not None else _key_and_position_from_numpy()
    return _same_key_and_position(live, (keys.numpy(), pos))


_MT_WORDS = 624
_mt_layout_checked: bool | None = None   # numpy's mt19937_state {uint32 key[624]; int pos} confirmed


def _mt19937_state() -> bytes | None:
    """The raw state struct of numpy's global MT19937, or None when it cannot be read that way.
    The layout is checked once against np.random.get_state, so a numpy that changes it only
    falls back to the slow path."""
    global _mt_layout_checked
    generator = getattr(np.random.mtrand._rand, "_bit_generator", None)
    if _mt_layout_checked is False or generator is None or type(generator).__name__ != "MT19937":
        return None
    raw = ctypes.string_at(generator.ctypes.state_address, 4 * _MT_WORDS + 4)
    if _mt_layout_checked is None:
        _mt_layout_checked = _same_key_and_position(_key_and_position(raw), _key_and_position_from_numpy())
    return raw if _mt_layout_checked else None


def _key_and_position(raw: bytes) -> tuple[np.ndarray, int]:
    return np.frombuffer(raw, np.uint32, _MT_WORDS), int.from_bytes(raw[4 * _MT_WORDS:], "little", signed=True)


def _key_and_position_from_numpy() -> tuple[np.ndarray, int]:
    _, keys, pos, _, _ = np.random.get_state(legacy=True)
    return np.asarray(keys), int(pos)


def _same_key_and_position(a: tuple, b: tuple) -> bool:
    return a[1] == b[1] and np.array_equal(a[0], b[0])


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


def owned_model_state(model: torch.nn.Module, foreign: frozenset, hidden: dict | None = None) -> dict:
    """``model.state_dict()`` without the ``foreign`` keys (see trained_elsewhere), and with the
    parameters a state-dict hook hides under their own names (``hidden``: see
    lowdiff.format.fullckpt.hidden_parameters)."""
    state = model.state_dict()
    if foreign:
        state = {key: value for key, value in state.items() if key not in foreign}
    if hidden:
        state.update({name: p.detach() for name, p in hidden.items()})
    return state
