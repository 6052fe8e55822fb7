"""Whether a full checkpoint fits the objects it is about to be loaded into.

Checked before anything is changed, so a wrong model, optimizer or compressor is refused with an
error that names the file and both sides, instead of a KeyError from inside torch after half of
the state was overwritten.
"""
from __future__ import annotations

import torch

from lowdiff.errors import IncompatibleCheckpointError
from lowdiff.format.fullckpt import hidden_parameters
from lowdiff.format.schema import FullIndex, FullState
from lowdiff.step.boundary import owned_model_state, trained_elsewhere


def class_path(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _param_names(model: torch.nn.Module, optimizer) -> list:
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(params)]


def _shown(items, limit: int = 4) -> str:
    items = list(items)
    return ", ".join(map(str, items[:limit])) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def check_compatible(path: str, index: FullIndex, state: FullState, model: torch.nn.Module, optimizer, *,
                     compressor=None, extra_state: dict | None = None) -> None:
    """Raise IncompatibleCheckpointError unless the checkpoint at ``path`` (its ``index`` and
    ``state``) can be loaded into ``model``, ``optimizer`` and ``extra_state`` and continued with
    ``compressor``."""
    def refuse(problem: str):
        raise IncompatibleCheckpointError(f"{path}: {problem}")

    trained = index.optimizer_class
    if trained and trained != class_path(optimizer):
        refuse(f"it was trained with optimizer {trained}; the optimizer given is {class_path(optimizer)}. "
               f"Resume with the same optimizer class (or export the state and convert it)")
    saved_groups = [len(g["params"]) for g in state.optimizer["param_groups"]]
    live_groups = [len(g["params"]) for g in optimizer.param_groups]
    if saved_groups != live_groups:
        refuse(f"its optimizer has param groups of {saved_groups} parameters; the optimizer given has {live_groups}")
    saved_names, live_names = list(index.param_names), _param_names(model, optimizer)
    if saved_names != live_names:
        differ = [f"#{i}: {a!r} vs {b!r}" for i, (a, b) in enumerate(zip(saved_names, live_names)) if a != b]
        refuse(f"its optimizer parameters are not the model's (checkpoint vs given): {_shown(differ)}")
    foreign = trained_elsewhere(model, optimizer)
    # The parameters a state-dict hook hides, as the file holds them (files written before it
    # recorded them lack them, and resume as before: the model's load hook rebuilds them).
    params = [p for group in optimizer.param_groups for p in group["params"]]
    hidden = {k: p for k, p in hidden_parameters(model, params).items() if k in state.model}
    _check_model(refuse, {k: v for k, v in state.model.items() if k not in foreign},
                 owned_model_state(model, foreign, hidden))
    if compressor is not None and index.compressor:
        saved_kind = index.compressor.split("(")[0]
        live_kind = type(compressor).__name__
        if saved_kind != live_kind:
            refuse(f"it was written with compressor {index.compressor}; the optimizer was wrapped with "
                   f"{compressor!r}. Changing the compressor kind would drop its per-rank state; wrap with "
                   f"{saved_kind} to resume")
    missing = sorted(set(extra_state or {}) - set(state.extra))
    if missing:
        refuse(f"it holds no state for extra_state {missing}; it has {sorted(state.extra)}")


def _check_model(refuse, saved: dict, live: dict) -> None:
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        refuse("its model state does not match the model given: "
               + "; ".join(p for p in (f"missing in the checkpoint: {_shown(missing)}" if missing else "",
                                       f"not in the model: {_shown(unexpected)}" if unexpected else "") if p))
    shapes = [f"{k}: {tuple(saved[k].shape)} vs {tuple(v.shape)}" for k, v in live.items()
              if isinstance(v, torch.Tensor) and isinstance(saved[k], torch.Tensor) and saved[k].shape != v.shape]
    if shapes:
        refuse(f"its model has other shapes than the model given (checkpoint vs given): {_shown(shapes)}")
