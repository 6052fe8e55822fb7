"""recovery.export: rebuild the state of a step without the training code, as a plain torch.save."""
from __future__ import annotations

import importlib
import os

import torch

from lowdiff.errors import CorruptCheckpointError, NoCheckpointError

from .restore import checkpoint_directory, restore


def _optimizer_class(path: str):
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import the optimizer class {path!r} the checkpoint was trained with: {exc}") from None


def export(directory, output, *, step: int | None = None) -> int:
    """Write ``{"step", "model", "optimizer", "scheduler", "extra", "rng"}`` for ``step`` (default:
    the newest durable step) to ``output`` with ``torch.save``; loadable without lowdiff. Parameters
    are rebuilt from the full checkpoint and replayed with the optimizer class recorded there."""
    directory = checkpoint_directory(directory)
    holder = {}

    def check_full(path, index, state):
        missing = [n for n in index.get("param_names", []) if n not in state["model"]]
        if "param_names" not in index or missing:
            raise CorruptCheckpointError(path, f"its index names optimizer parameters its model state lacks: {missing[:4]}")

    def apply_full(index, state):
        model_state = dict(state["model"])
        names = index["param_names"]
        params = [torch.nn.Parameter(model_state[name].clone()) for name in names]
        saved = state["optimizer"]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[i] for i in g["params"]]}
                  for g in saved["param_groups"]]
        optimizer = _optimizer_class(index["optimizer_class"])(groups)
        optimizer.load_state_dict(saved)
        holder.update(params=params, optimizer=optimizer, model_state=model_state, names=names)

    restored = restore(directory, check_full=check_full, apply_full=apply_full,
                       params_for=lambda index: holder["params"], optimizer_for=lambda index: holder["optimizer"],
                       stop_step=step)
    if restored is None:
        raise NoCheckpointError(f"{directory} holds no checkpoint")
    model_state = holder["model_state"]
    aliases = restored.full_index.get("param_aliases", {})
    for slot, name in enumerate(holder["names"]):
        model_state[name] = holder["params"][slot].detach()
    for key, slot in aliases.items():  # tied weights stored under several keys
        model_state[key] = holder["params"][slot].detach()
    state = restored.full_state
    out = {"step": restored.step, "model": model_state, "optimizer": holder["optimizer"].state_dict(),
           "scheduler": state.get("scheduler"), "extra": state.get("extra"), "rng": state.get("rng")}
    record = restored.last_record
    if record is not None:
        model_state.update(record.objects["buffers"])
        out["scheduler"] = record.objects.get("scheduler")
        out["extra"] = record.objects["extra"]
        out["rng"] = record.objects["rng"]
    # Tensors loaded from a full checkpoint are views of one read buffer, some under different
    # dtypes, which torch.save refuses (and would otherwise store the whole buffer): give each its own.
    torch.save(_own_storage(out), os.fspath(output))
    return restored.step


def _own_storage(node):
    if isinstance(node, torch.Tensor):
        return node.detach().clone()
    if isinstance(node, dict):
        return {k: _own_storage(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_own_storage(v) for v in node)
    return node
