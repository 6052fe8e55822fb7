"""Training-loop patterns lowdiff cannot make exact: refused at ``wrap()`` when they would fail
half-way through a step, named in a warning (once) when they can only be seen while training runs.

Refused, before anything is written: optimizers that re-evaluate the loss several times per step
(LBFGS: one recorded gradient cannot replay it), sparse gradients (SparseAdam, ``sparse=True``
embeddings), and a ``scheduler`` whose ``step()`` needs arguments (ReduceLROnPlateau needs a metric;
lowdiff would call it without one after the optimizer had already stepped).

Loops that do work between steps (validation, ReduceLROnPlateau, an EMA, a scheduler the loop
steps) use ``wrap(options=lowdiff.Options(boundary="manual"))`` and call ``opt.boundary()`` when that work is done.

Warned: an LR scheduler attached to the optimizer but given to lowdiff neither as ``scheduler`` nor
in ``extra_state`` (its position would not be saved), and a scheduler stepped between two
``opt.step()`` calls — the one given as ``scheduler`` (lowdiff steps it too: twice per step) or one
in ``extra_state`` (captured at the end of ``opt.step()``, before the loop stepped it, so a resumed
schedule would lag by a step) — and an ``AveragedModel`` (EMA) in ``extra_state`` updated between
them (a resumed average would lag one update). Random numbers drawn and buffers changed between
steps: lowdiff.capture.betweensteps. A torchdata ``StatefulDataLoader`` in ``extra_state`` built in
a way whose saved state does not resume exactly (torchdata 0.11; the guide's recipe is exact).
"""
from __future__ import annotations

import inspect
import os
import sys
import types
import warnings

import torch

_PLATEAU_HINT = ("Step it yourself after validation, pass it in extra_state and wrap with "
                 "options=lowdiff.Options(boundary=\"manual\"), calling opt.boundary() once that work is done")


def refuse_unreplayable(optimizer, model, scheduler) -> None:
    """Raise (TypeError/ValueError naming the object and what to do) for what cannot be recorded."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError("torch.optim.LBFGS evaluates the closure several times per step, each time with "
                        "new gradients: one recorded gradient cannot replay its step, so lowdiff cannot "
                        "checkpoint it per step (checkpoint it with full state saves instead)")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise TypeError("torch.optim.SparseAdam needs sparse gradients, which lowdiff does not record")
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) is True and isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            raise ValueError(f"module {name!r} ({type(module).__name__}) has sparse=True: its sparse gradients "
                             f"are not recorded; build it with sparse=False")
    if scheduler is not None and _step_needs_arguments(scheduler):
        raise TypeError(f"scheduler ({type(scheduler).__name__}) needs arguments to step(); lowdiff steps "
                        f"the scheduler without arguments at the end of opt.step(). " + _PLATEAU_HINT)


def _step_needs_arguments(scheduler) -> bool:
    try:
        signature = inspect.signature(scheduler.step)
    except (TypeError, ValueError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in signature.parameters.values())


def warn_unsaved_scheduler(optimizer, scheduler, extra_state) -> None:
    """torch marks an optimizer's step once an LR scheduler is built on it; if lowdiff was given
    no scheduler of that optimizer, its position would be lost at resume."""
    if not getattr(getattr(optimizer, "step", None), "_wrapped_by_lr_sched", False):
        return
    given = [scheduler, *(extra_state or {}).values()]
    if any(getattr(obj, "optimizer", None) is optimizer for obj in given if obj is not None):
        return
    warnings.warn("an LR scheduler is attached to this optimizer but lowdiff was not given it: its position "
                  "is not checkpointed and a resumed run would restart the schedule. Pass it as "
                  "wrap(scheduler=...) and let opt.step() step it (do not step it yourself)",
                  RuntimeWarning, stacklevel=4)


def _position(obj):
    """How far a scheduler has stepped (its ``last_epoch``, or for one that only steps others —
    ``ChainedScheduler`` has no ``last_epoch`` of its own — the positions of those), or how many
    updates an ``AveragedModel`` (EMA, SWA) has averaged."""
    if isinstance(obj, torch.optim.swa_utils.AveragedModel):
        return int(obj.n_averaged.item())
    if hasattr(obj, "last_epoch"):
        return obj.last_epoch
    return tuple(_position(inner) for inner in getattr(obj, "_schedulers", ()))


class SchedulerWatch:
    """Sees schedulers stepped, and EMAs (``AveragedModel``) updated, between ``opt.step()`` calls
    (by their position, see _position)."""

    def __init__(self, scheduler, extra_state: dict):
        self.watched = {"scheduler": scheduler} if scheduler is not None else {}
        self.watched.update({f"extra_state[{name!r}]": obj for name, obj in extra_state.items()
                             if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler,
                                                 torch.optim.swa_utils.AveragedModel))})
        self.seen: dict[str, int] = {}
        self.warned: set[str] = set()

    def step_finished(self) -> None:
        """At the end of ``opt.step()``, after lowdiff stepped its scheduler and captured state."""
        for name, obj in self.watched.items():
            self.seen[name] = _position(obj)

    def step_starting(self) -> None:
        for name, obj in self.watched.items():
            position = _position(obj)
            if name in self.warned or self.seen.get(name, position) == position:
                continue
            self.warned.add(name)
            if name == "scheduler":
                why = ("it is stepped outside opt.step() as well as by lowdiff (which steps it at the end of "
                       "opt.step()): twice per step. Do not step it yourself")
            elif isinstance(obj, torch.optim.swa_utils.AveragedModel):
                why = ("it is updated after lowdiff captured it at the iteration boundary (the end of "
                       "opt.step(), or opt.boundary()): a resumed average would lag one update. Wrap with "
                       "options=lowdiff.Options(boundary=\"manual\") and call opt.boundary() after updating it")
            else:
                why = ("it is stepped after lowdiff captured it at the iteration boundary (the end of "
                       "opt.step(), or opt.boundary()): a resumed schedule would lag one step. Pass it as "
                       "wrap(scheduler=...) and do not step it yourself, or wrap with "
                       "options=lowdiff.Options(boundary=\"manual\") and call opt.boundary() after stepping it")
            warnings.warn(f"lowdiff: {name} ({type(obj).__name__}): {why}", RuntimeWarning, stacklevel=4)


def calling_grad_scaler(depth: int = 4):
    """The GradScaler whose ``step(optimizer)`` is calling ``opt.step()`` right now, if any (found
    as ``self`` of a caller frame). A GradScaler lowdiff was not given skips steps without
    lowdiff seeing them and changes its scale unrecorded."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        # Only a method's frame can be GradScaler's; f_locals of others (the training loop's,
        # with all its variables) would be built into a dict at every step for nothing.
        if "self" in frame.f_code.co_varnames:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, torch.amp.GradScaler):
                return candidate
        frame = frame.f_back
    return None


def warn_unknown_scaler(scaler) -> None:
    warnings.warn(f"lowdiff: a {type(scaler).__name__} steps this optimizer but was not given to "
                  f"wrap(grad_scaler=...): the steps it skips (inf/nan gradients) are not recorded and its scale "
                  f"is not saved, so a resumed run would diverge. Pass it to wrap()", RuntimeWarning, stacklevel=4)


_STATEFUL_RECIPE = ("build it as docs/guide.md (\"torchdata's StatefulDataLoader\") does: "
                    "StatefulDataLoader(data, ..., sampler=torchdata.stateful_dataloader.sampler.RandomSampler(data, "
                    "generator=torch.Generator().manual_seed(1)), generator=torch.Generator().manual_seed(2)), "
                    "or use lowdiff.ResumableLoader(DataLoader(data, ..., shuffle=True))")


def warn_inexact_loaders(extra_state: dict) -> None:
    """Warn (at wrap) about a torchdata ``StatefulDataLoader`` in ``extra_state`` whose saved state
    does not resume exactly, naming why and the recipe that does (docs/guide.md). Found by type
    name: lowdiff does not import torchdata."""
    for name, loader in extra_state.items():
        kind = type(loader)
        if kind.__name__ != "StatefulDataLoader" or not kind.__module__.startswith("torchdata."):
            continue
        sampler = getattr(loader, "sampler", None)
        why = []
        if getattr(loader, "generator", None) is None:
            why.append("it has no generator=, so a resumed run's first iter() draws the workers' base seed from "
                       "the global torch RNG that recovery.resume() restored (the uninterrupted run drew it when the "
                       "epoch started): every later random number (dropout) differs")
        if type(sampler) is torch.utils.data.RandomSampler:
            why.append("its sampler is torch's RandomSampler, which has no state: the loader replays it from its "
                       "generator's current state to skip the consumed batches, which is another permutation")
        elif (getattr(sampler, "generator", None) is not None and getattr(sampler, "generator", None) is
              loader.generator and not loader.num_workers):
            why.append("shuffle=True with generator=g shuffles from the generator that also gives each epoch's "
                       "base seed; its saved state misses that draw, so with num_workers=0 every epoch after the "
                       "resumed one is shuffled differently (torchdata 0.11)")
        if why:
            warnings.warn(f"lowdiff: extra_state[{name!r}] (StatefulDataLoader) does not resume exactly as built: "
                          f"{'; and '.join(why)}. To make it exact, {_STATEFUL_RECIPE}", RuntimeWarning, stacklevel=4)


_OURS_AND_TORCHS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    os.path.dirname(os.path.abspath(torch.__file__)))


def step_scheduler_of_skipped(scheduler, step: int) -> None:
    """Step ``scheduler`` after a step the GradScaler skipped. torch warns then (on the first
    step) that the scheduler stepped before the optimizer: the plain loop ``scaler.step(opt);
    sched.step()`` gets the same warning at the user's ``sched.step()`` line; here it would point
    into lowdiff. It is said again at the user's line (the first frame outside lowdiff and torch),
    explained; any other warning the step gives is passed on as it was."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")    # recorded, not raised, whatever the caller's filters say
        scheduler.step()
    for w in caught:
        if str(w.message).startswith("Detected call of `lr_scheduler.step()` before `optimizer.step()`"):
            warnings.warn(f"{w.message} (lowdiff: the GradScaler skipped step {step} — inf/NaN gradients, the "
                          f"optimizer did not step — and lowdiff stepped the scheduler after it, as the loop "
                          f"scaler.step(opt); sched.step() does without lowdiff, which gets this warning too: it is "
                          f"about the skipped step, the order is right, and the checkpoints record it as it happened)",
                          w.category, stacklevel=_outside(2))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def _outside(level: int) -> int:
    """The stacklevel, seen from a function ``level`` frames below this one's caller, of the first
    frame outside lowdiff and torch."""
    frame: types.FrameType | None = sys._getframe(level)
    while frame is not None and frame.f_code.co_filename.startswith(_OURS_AND_TORCHS):
        frame, level = frame.f_back, level + 1
    return level
