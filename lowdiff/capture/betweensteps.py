"""Random numbers drawn and buffers changed between iterations, at some steps but not at others.

lowdiff captures the RNG states and the module buffers at the iteration boundary (the end of
``opt.step()``, or ``opt.boundary()``). Whatever the loop does after that and before the next
training forward happens outside what a checkpoint holds. When the loop does the same thing
after every step (drawing the next batch's noise from the global RNG, say) a resumed run does it
too and stays exact. When it does it only at some steps — a validation pass every N steps that
draws random numbers or runs BatchNorm in train mode, a ``DataLoader`` without ``generator=``
drawing its base seed as an epoch starts — a run resumed at some step redoes or skips that work
depending on where it resumes, and its random numbers or buffers differ from this run's.

``BetweenStepsWatch`` sees that pattern: a forward pre-hook on the model compares, at the first
training forward (train mode, gradients enabled) after each boundary, every RNG and every
persistent buffer with what the boundary captured, and warns once per kind (RNG, buffers) as
soon as one changed after some steps and not after others, naming which and at which steps.

Work done after *every* step looks like the loop's ordinary per-step work (drawing the next
batch's noise at the top of the loop), which a resumed run repeats. What tells them apart is a
resume: between ``recovery.resume`` (which restored the RNGs and buffers) and the first training
forward, a resumed run does only the top of its loop, not the work after ``opt.step()`` of the step
it resumed at. So the watch compares that window with the next one (after the first boundary of the
resumed run): a source changed in one and not in the other means this run now differs from the
uninterrupted one, and one warning (per kind) names it. Changed after the step but not after the
resume: work after ``opt.step()`` (validation drawing random numbers, or without ``model.eval()``).
Changed after the resume only: work that runs once after the resume (a ``DataLoader`` iterator made
then, without ``generator=``, draws its seeds from the restored RNG) — exact only if the
uninterrupted run did the same there (an epoch starting at exactly that step), which the warning says.

What it cannot see, and the guide says so: a source changed in both windows for different
reasons (validation drawing after each step *and* noise drawn at the top of the loop), work that
changes a generator it does not know (a ``torch.Generator`` of the user's: those are the user's to
save, e.g. in ``extra_state``), and loops whose training forward does not call the model given to
``wrap`` (or runs compiled by ``torch.compile``, where the hook stays out of the graph and checks
nothing). The first window after ``wrap()`` is not judged: it holds one-off setup work; the first
after a resume is judged only by the comparison above, not as one of the steps.
"""
from __future__ import annotations

import os
import sys
import types
import warnings

import torch

from lowdiff.step.boundary import numpy_state_matches, python_state_matches

_SHOWN_STEPS = 4


class BetweenStepsWatch:
    """Arm at each iteration boundary (``boundary_passed``); the model's forward pre-hook judges
    the window at the next training forward. ``remove()`` takes the hook off (at close)."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._armed = False
        self._step = 0
        self._boundary: dict | None = None
        # What changed after which steps, by source ("torch", "buffer 'bn.running_mean'", ...),
        # and after which steps it did not (the first few of each).
        self._changed: dict[str, dict[str, list[int]]] = {"rng": {}, "buffers": {}}
        self._unchanged: dict[str, dict[str, list[int]]] = {"rng": {}, "buffers": {}}
        self._warned: set[str] = set()
        self._resumed_at: int | None = None     # the step a resume restored, until its windows are judged
        self._resume_window: dict[str, set[str]] | None = None   # what changed from resume to forward
        self._handle = model.register_forward_pre_hook(self._forward_starts)

    def remove(self) -> None:
        self._handle.remove()
        self._armed = False

    def boundary_passed(self, step: int, boundary: dict | None) -> None:
        """At the boundary after ``step``: ``boundary`` holds the "rng" and "buffers" it captured
        (StepCapture.capture_boundary); None at wrap or resume, whose window is not judged."""
        self._step, self._boundary, self._armed = step, boundary, True
        if boundary is None:            # wrap, a resume, or a window the caller asked not to judge
            self._resumed_at = self._resume_window = None

    def resumed(self, step: int, restored: dict) -> None:
        """After ``recovery.resume`` restored step ``step``: ``restored`` holds the "rng" and
        "buffers" as restored. The window to the first training forward is compared with the next."""
        self.boundary_passed(step, None)
        self._boundary, self._resumed_at = restored, step

    # ------------------------------------------------------------ the hook
    def _forward_starts(self, module, args) -> None:
        if torch.compiler.is_compiling() or not self._armed:   # compiling first: no guard on _armed
            return
        if not (module.training and torch.is_grad_enabled()):
            return   # an evaluation forward: what it changed shows at the training forward
        self._armed = False
        boundary, self._boundary = self._boundary, None
        if boundary is None:
            return
        rng = changed_rng_sources(boundary["rng"])
        captured = boundary["buffers"]
        buffers: set[str] = set()
        if captured:   # no buffers: no walk over the modules at every step
            live = {name: buf for name, buf in self._model.named_buffers() if name in captured}
            buffers = {name for name, value in captured.items() if name not in live or not _same(live[name], value)}
        if self._resumed_at is not None and self._resume_window is None:
            self._resume_window = {"rng": rng, "buffers": buffers}    # judged with the next window
            return
        self._note("rng", rng_sources(boundary["rng"]), rng)
        if captured:
            self._note("buffers", sorted(captured), buffers)
        if self._resume_window is not None:
            resumed_at, window = self._resumed_at, self._resume_window
            self._resumed_at = self._resume_window = None
            assert resumed_at is not None
            differs = {kind: (sorted(window[kind] - changed), sorted(changed - window[kind]))
                       for kind, changed in (("rng", rng), ("buffers", buffers)) if window[kind] != changed}
            if differs and "resume" not in self._warned:
                self._warned.add("resume")
                _warn_resumed(resumed_at, differs)

    def _note(self, kind: str, sources: list[str], changed: set[str]) -> None:
        changed_after, unchanged_after = self._changed[kind], self._unchanged[kind]
        for source in sources:
            after = changed_after if source in changed else unchanged_after
            seen = after.setdefault(source, [])
            if len(seen) < _SHOWN_STEPS:
                seen.append(self._step)
        if kind in self._warned:
            return
        mixed = [s for s in sources if s in changed_after and s in unchanged_after]
        if mixed:
            self._warned.add(kind)
            _warn(kind, mixed, changed_after, unchanged_after)


def _same(live: torch.Tensor, captured: torch.Tensor) -> bool:
    # BatchNorm's kernels update running statistics without bumping version counters: compare values.
    return live.shape == captured.shape and live.dtype == captured.dtype and torch.equal(live, captured)


def rng_sources(rng: dict) -> list[str]:
    return ["torch", "python random", "numpy"] + [f"cuda:{i}" for i in range(len(rng.get("cuda", ())))]


def changed_rng_sources(rng: dict) -> set[str]:
    """Which generators differ from the captured states ``rng`` (see capture.capture_rng)."""
    changed = set()
    if not torch.equal(torch.get_rng_state(), rng["torch"]):
        changed.add("torch")
    if not python_state_matches(rng["python"]):
        changed.add("python random")
    if not numpy_state_matches(rng["numpy"]):
        changed.add("numpy")
    for i, state in enumerate(rng.get("cuda", ())):
        if not torch.equal(torch.cuda.get_rng_state(i), state):
            changed.add(f"cuda:{i}")
    return changed


def _steps(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:_SHOWN_STEPS - 1])
    return shown + (", ..." if len(steps) >= _SHOWN_STEPS else "")


def _warn(kind: str, mixed: list[str], changed_after: dict, unchanged_after: dict) -> None:
    first = mixed[0]
    what = (f"the {', '.join(mixed)} RNG{'s were' if len(mixed) > 1 else ' was'} drawn from" if kind == "rng"
            else f"buffer{'s' if len(mixed) > 1 else ''} {', '.join(repr(m) for m in mixed[:3])}"
                 f"{f' and {len(mixed) - 3} more' if len(mixed) > 3 else ''} changed")
    hint = ("draw from a torch.Generator of your own for that work (DataLoader(generator=...), or "
            "lowdiff.ResumableLoader)" if kind == "rng" else
            "put the model in eval() for evaluation forwards")
    warnings.warn(
        f"lowdiff: {what} between an iteration boundary (the end of opt.step(), or opt.boundary()) and the "
        f"next training forward after step(s) {_steps(changed_after[first])} but not after step(s) "
        f"{_steps(unchanged_after[first])} (a validation pass, an epoch starting, ...). Checkpoints hold the "
        f"state of the boundary: a run resumed at one of these steps redoes or skips that work depending on "
        f"where it resumes, and then differs from this run. To make it exact, {hint}, or wrap with "
        f"options=lowdiff.Options(boundary=\"manual\") and call opt.boundary() once that work is done. Shown once.",
        RuntimeWarning, stacklevel=_caller_stacklevel())


def _warn_resumed(step: int, differs: dict[str, tuple[list[str], list[str]]]) -> None:
    """Warn (one warning) that the window after the resume at ``step`` differs from the next one
    (see the module docstring): by kind, (changed after the resume only, after the step only)."""
    parts: list[str] = []
    for kind, (only_resume, only_step) in differs.items():
        parts += _resumed_parts(kind, step, only_resume, only_step, again=bool(parts))
    warnings.warn("lowdiff: " + "; and ".join(parts) + ". Shown once.", RuntimeWarning,
                  stacklevel=_caller_stacklevel())


def _resumed_parts(kind: str, step: int, only_resume: list[str], only_step: list[str], again: bool) -> list[str]:
    """The sentences of _warn_resumed for one kind; ``again``: another kind was named before (the
    buffers after the RNG: the same work, said briefly)."""
    def named(sources: list[str]) -> str:
        if kind == "rng":
            return f"the {', '.join(sources)} RNG{'s were' if len(sources) > 1 else ' was'} drawn from"
        shown = ", ".join(repr(s) for s in sources[:3]) + (f" and {len(sources) - 3} more" if len(sources) > 3 else "")
        return f"buffer{'s' if len(sources) > 1 else ''} {shown} changed"
    parts = []
    if only_step:
        fix = ("draw that work's random numbers from a torch.Generator of your own" if kind == "rng"
               else "put the model in eval() for evaluation forwards")
        if again:
            return [f"{named(only_step)} there too (to make that exact, {fix})"]
        parts.append(
            f"{named(only_step)} between opt.step() of step {step + 1} (the iteration boundary) and the next "
            f"training forward, but not between recovery.resume() and the first training forward: work the loop "
            f"does after opt.step() (a validation pass?) happens after what a checkpoint holds, and this resumed "
            f"run did not redo it for step {step}, so it now differs from the uninterrupted run. To make it "
            f"exact, {fix}, or wrap with options=lowdiff.Options(boundary=\"manual\") and call opt.boundary() "
            f"once that work is done")
    if only_resume:
        fix = ("give the DataLoader a generator of its own (DataLoader(..., generator=torch.Generator()."
               "manual_seed(s))) or use lowdiff.ResumableLoader, and make any other draw before recovery.resume() "
               "or from a torch.Generator of your own" if kind == "rng"
               else "run that forward before recovery.resume(), or in eval()")
        cause = ("a DataLoader iterator made after the resume draws its base seed (and, without generator=, its "
                 "shuffle) from the global RNG" if kind == "rng" else "a forward in train mode after the resume")
        parts.append(
            f"{named(only_resume)} between recovery.resume() (which restored the state of step {step}) and the first "
            f"training forward, but not between later steps. Likely cause: {cause}. Unless the uninterrupted run did "
            f"the same after step {step} (an epoch starting exactly there), this run now differs from it. To make it "
            f"exact, {fix}")
    return parts


_INTERNAL = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside lowdiff and torch (the user's forward call)."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
