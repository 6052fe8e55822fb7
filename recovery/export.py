"""recovery.export: rebuild the state of a step without the training code, as a plain torch.save or
as a torch.distributed.checkpoint (DCP) directory."""
from __future__ import annotations

import dataclasses
import importlib
import os

import torch

from lowdiff.distributed.partition import is_partitioned
from lowdiff.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError
from recovery.execute import Restored
from recovery.partitioned import dcpexport
from recovery.partitioned.restore import restore_partitioned
from recovery.plan import checkpoint_directory, warn
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
    "scheduler", "extra", "rng"}``; "dcp": a torch.distributed.checkpoint directory
    (recovery.partitioned.dcpexport), written share by share without gathering when the directory
    holds sharded (FSDP2) state."""
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}: one of {', '.join(FORMATS)}")
    if format == "dcp" and os.path.exists(output) and not os.path.isdir(output):
        raise ValueError(f"{os.fspath(output)}: exists and is not a directory (a DCP export writes a directory)")
    directory = checkpoint_directory(directory)
    rebuilt = None
    if format == "dcp" and is_partitioned(directory):
        first = _rebuild(directory, step, as_share=0)   # share 0's own state: whole tensors if nothing is sharded
        share = dcpexport.share_index(first.path)
        if not share.dtensors:
            rebuilt = first   # (as a plain export's: rank 0's share, every tensor whole)
        elif _export_shares(output, directory, first, share.count, share.dtensors):
            return first.restored.step
        # else the shares start from different sets: whole tensors (see _export_shares)
    rebuilt = rebuilt or _rebuild(directory, step)
    restored = rebuilt.restored
    if format == "dcp":
        state, _ = dcpexport.dcp_state(rebuilt.model_state, rebuilt.optimizer, rebuilt.names, restored.step)
        dcpexport.save_gathered(output, _own_storage(state))
        return restored.step
    boundary = restored.boundary
    out = {"step": restored.step, "model": rebuilt.model_state, "optimizer": rebuilt.optimizer.state_dict(),
           "scheduler": boundary.scheduler, "extra": boundary.extra, "rng": boundary.rng}
    # Tensors loaded from a full checkpoint are views of one read buffer, some under different
    # dtypes, which torch.save refuses (and would otherwise store the whole buffer): give each its own.
    torch.save(_own_storage(out), os.fspath(output))
    return restored.step


@dataclasses.dataclass(frozen=True)
class _Rebuilt:
    restored: Restored
    model_state: dict       # state-dict key -> tensor (parameters as replayed, buffers at the step)
    optimizer: torch.optim.Optimizer   # over the replayed parameters, in the index's slot order
    names: dict             # id(parameter) -> its name
    path: str               # the full checkpoint (of a partitioned directory: the share) it started from


def _rebuild(directory: str, step: int | None, as_share: int | None = None) -> _Rebuilt:
    """The state of ``step`` in this process: whole tensors, or (``as_share``, a partitioned
    directory) share ``as_share``'s own state with its DTensor chunks as written, replayed."""
    holder: dict = {}

    def check_full(path, index, state):
        missing = [n for n in index.param_names if n not in state.model]
        if missing:
            hint = _hidden_hint(missing, state.model, index.param_aliases)
            raise CorruptCheckpointError(path, f"its index names optimizer parameters its model state lacks: "
                                               f"{missing[:4]}{hint}")
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
                                          params_for=params_for, optimizer_for=optimizer_for, stop_step=step,
                                          as_share=as_share)
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
    # (At the full checkpoint's own step they still match the parameters, and its buffers are in
    # its model state, not in a record's ``buffers``: kept as the model gave them.)
    made = _made_by_hooks(model_state, index.param_aliases, boundary.buffers) \
        if restored.step != restored.full_step else []
    if made:
        warn(f"lowdiff: export: model state keys {sorted(made)[:4]}{' and more' if len(made) > 4 else ''} are neither "
             f"parameters nor buffers (a state_dict hook made them from parameters at step {restored.full_step}, "
             f"which a replay does not move): left out; the parameters are exported under their own names")
        for key in made:
            del model_state[key]
    names = {id(p): name for name, p in zip(index.param_names, holder["params"])}
    return _Rebuilt(restored, model_state, holder["optimizer"], names, restored.full_file)


def _made_by_hooks(model_state: dict, aliases: dict, buffers: dict) -> list:
    """Tensors of a model state that are neither a parameter's key nor a buffer (``buffers``: a
    record's, all the persistent ones): what a state-dict hook made from parameters (torchtitan's
    ``wq``/``wk``/``wv`` cut from its fused ``wqkv``) and stored as of the full checkpoint's step.
    Without the model's code they cannot be made again at a later step (docs/format.md,
    "Parameters the model's state_dict() does not hand out")."""
    return [key for key, value in model_state.items() if isinstance(value, torch.Tensor) and key not in aliases
            and key not in buffers and not key.endswith("_extra_state")]   # (torch's get_extra_state key)


def _hidden_hint(missing: list, model_state: dict, aliases: dict) -> str:
    """Why a full checkpoint may lack parameters: other keys of their modules, not parameters, stand
    in their place (a state-dict hook), and the file predates lowdiff storing such parameters."""
    def near(key: str) -> set:   # its module and that module's parent (where such hooks sit)
        module = key.rpartition(".")[0]
        return {module, module.rpartition(".")[0]} - {""}
    around = set().union(*(near(name) for name in missing))
    stand_ins = [k for k in model_state if k not in aliases and near(k) & around]
    if not stand_ins:
        return ""
    return (f"; the model's state_dict() hooks put {stand_ins[:3]} in their place, and this file was written "
            f"before lowdiff stored such parameters under their own names: resume the run with its model and "
            f"let it take a full checkpoint, then export a step from that one on")


def _export_shares(output, directory: str, first: _Rebuilt, count: int, chunks: dict) -> bool:
    """Write the DCP directory share by share (recovery.partitioned.dcpexport), each share's state
    rebuilt in turn at ``first``'s step. False, with nothing committed, when a share's state starts
    from another full set than share 0's (its own chunks of the newer one did not verify): its
    chunks may be cut otherwise, so the caller writes whole tensors instead, from the set that every
    share verifies (the gathered path reads and checks every chunk)."""
    restored = first.restored
    writer = dcpexport.ShardedWriter(output, count)
    rebuilt = first
    for share in range(count):
        if share:
            try:
                rebuilt = _rebuild(directory, restored.step, as_share=share)
            except CheckpointError as exc:
                warn(f"lowdiff: share {share} of step {restored.step} cannot be rebuilt on its own ({exc}): "
                     f"exporting whole tensors instead of each share's chunks")
                writer.abandon()
                return False
            if (rebuilt.restored.full_step, rebuilt.restored.full_index.session) != \
                    (restored.full_step, restored.full_index.session):
                warn(f"lowdiff: share {share} of step {restored.step} starts from the full checkpoint of step "
                     f"{rebuilt.restored.full_step}, share 0 from step {restored.full_step}: exporting whole "
                     f"tensors instead of each share's chunks")
                writer.abandon()
                return False
            chunks = dict(dcpexport.share_index(rebuilt.path).dtensors)
        state, keys = dcpexport.dcp_state(rebuilt.model_state, rebuilt.optimizer, rebuilt.names, restored.step)
        writer.add(share, _own_storage(state), keys, chunks)
    writer.commit()
    return True


def _own_storage(node):
    if isinstance(node, torch.Tensor):
        return node.detach().clone()
    if isinstance(node, dict):
        return {k: _own_storage(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_own_storage(v) for v in node)
    return node
