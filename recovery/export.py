"""recovery.export: rebuild the state of a step without the training code, as a plain torch.save or
as a torch.distributed.checkpoint (DCP) directory."""
from __future__ import annotations

import importlib
import os
import warnings

import torch

from lowdiff.distributed.partition import is_partitioned
from lowdiff.errors import CorruptCheckpointError, NoCheckpointError
from recovery.partitioned.restore import restore_partitioned
from recovery.plan import checkpoint_directory
from recovery.restore import restore


def _optimizer_class(path: str):
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import the optimizer class {path!r} the checkpoint was trained with: {exc}") from None


FORMATS = ("torch", "dcp")


def export(directory: str | os.PathLike[str], output: str | os.PathLike[str], *, step: int | None = None,
           format: str = "torch") -> int:
    """Write the state of ``step`` (default: the newest durable step) to ``output``; loadable without
    lowdiff. Parameters are rebuilt from the full checkpoint and replayed with the optimizer class
    recorded there. ``format`` "torch": one ``torch.save`` file of ``{"step", "model", "optimizer",
    "scheduler", "extra", "rng"}``; "dcp": a torch.distributed.checkpoint directory (see _save_dcp)."""
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}: one of {', '.join(FORMATS)}")
    if format == "dcp" and os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"{os.fspath(output)}: exists and is not a directory (a DCP export writes a directory)")
    directory = checkpoint_directory(directory)
    holder: dict = {}

    def check_full(path, index, state):
        missing = [n for n in index.param_names if n not in state.model]
        if missing:
            raise CorruptCheckpointError(path, f"its index names optimizer parameters its model state lacks: "
                                               f"{missing[:4]}")
        _optimizer_class(index.optimizer_class)

    def apply_full(index, state):
        params = [torch.nn.Parameter(state.model[name].clone()) for name in index.param_names]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[i] for i in g["params"]]}
                  for g in state.optimizer["param_groups"]]
        optimizer = _optimizer_class(index.optimizer_class)(groups)
        optimizer.load_state_dict(state.optimizer)
        holder.update(params=params, optimizer=optimizer)

    def params_for(index):
        return holder["params"]

    def optimizer_for(index):
        return holder["optimizer"]
    restored = None
    if is_partitioned(directory):   # one process reads every share; rank 0's per-rank state is exported
        restored, _ = restore_partitioned(directory, check_full=check_full, apply_full=apply_full,
                                          params_for=params_for, optimizer_for=optimizer_for, stop_step=step)
    if restored is None:
        restored = restore(directory, check_full=check_full, apply_full=apply_full, params_for=params_for,
                           optimizer_for=optimizer_for, stop_step=step)
    if restored is None:
        raise NoCheckpointError(f"{directory} holds no checkpoint")
    index, boundary = restored.full_index, restored.boundary
    model_state = dict(restored.full_state.model)
    for slot, name in enumerate(index.param_names):
        model_state[name] = holder["params"][slot].detach()
    for key, slot in index.param_aliases.items():  # tied weights stored under several keys
        model_state[key] = holder["params"][slot].detach()
    model_state.update(boundary.buffers)
    if format == "dcp":
        names = {id(p): name for name, p in zip(index.param_names, holder["params"])}
        _save_dcp(output, _own_storage(model_state), holder["optimizer"], names, restored.step)
        return restored.step
    out = {"step": restored.step, "model": model_state, "optimizer": holder["optimizer"].state_dict(),
           "scheduler": boundary.scheduler, "extra": boundary.extra, "rng": boundary.rng}
    # Tensors loaded from a full checkpoint are views of one read buffer, some under different
    # dtypes, which torch.save refuses (and would otherwise store the whole buffer): give each its own.
    torch.save(_own_storage(out), os.fspath(output))
    return restored.step


def _save_dcp(output, model_state: dict, optimizer, names: dict, step: int) -> None:
    """A DCP directory whose keys are those of ``get_state_dict(model, optimizer,
    options=StateDictOptions(flatten_optimizer_state_dict=True))`` (model FQNs; "state.<fqn>.<name>";
    "param_groups.<fqn>.<key>"), plus "lowdiff.step". The tensors are whole (gathered from every
    share by this one process) and written by DCP's own writer as one chunk each; ``dcp.load`` cuts
    out each rank's chunk at any world size. Only the optimizer's per-parameter state and groups
    are exported: the scheduler, extra state and RNG are not (the torch format has rank 0's)."""
    import torch.distributed.checkpoint as dcp

    state: dict = dict(model_state)
    for group in optimizer.param_groups:
        for param in group["params"]:
            fqn = names[id(param)]
            for key, value in optimizer.state.get(param, {}).items():
                state[f"state.{fqn}.{key}"] = _own_storage(value)
            for key, value in group.items():
                if key != "params":
                    state[f"param_groups.{fqn}.{key}"] = value
    state["lowdiff.step"] = step
    # no_dist: this one process writes everything, even inside a job with a process group; DCP warns
    # that it assumes so whenever no_dist holds, which here is the intent, not a problem.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(state, checkpoint_id=os.fspath(output), no_dist=True)


def _own_storage(node):
    if isinstance(node, torch.Tensor):
        return node.detach().clone()
    if isinstance(node, dict):
        return {k: _own_storage(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_own_storage(v) for v in node)
    return node
