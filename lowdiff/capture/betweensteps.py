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

What it cannot see, and the guide says so: work done after *every* step (it looks like the
loop's ordinary per-step work, which is exact), work that changes a generator it does not know
(a ``torch.Generator`` of the user's: those are the user's to save, e.g. in ``extra_state``), and
loops whose training forward does not call the model given to ``wrap`` (or runs compiled by
``torch.compile``, where the hook stays out of the graph and checks nothing). The first window
after ``wrap()`` or a resume is not judged: it holds one-off setup work.
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
        self._handle = model.register_forward_pre_hook(self._forward_starts)

    def remove(self) -> None:
        self._handle.remove()
        self._armed = False

    def boundary_passed(self, step: int, boundary: dict | None) -> None:
        """At the boundary after ``step``: ``boundary`` holds the "rng" and "buffers" it captured
        (StepCapture.capture_boundary); None at wrap or resume, whose window is not judged."""
        self._step, self._boundary, self._armed = step, boundary, True

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
        self._note("rng", rng_sources(boundary["rng"]), changed_rng_sources(boundary["rng"]))
        captured = boundary["buffers"]
        if not captured:
            return   # no buffers: no walk over the modules at every step
        live = {name: buf for name, buf in self._model.named_buffers() if name in captured}
        changed = {name for name, value in captured.items()
                   if name not in live or not _same(live[name], value)}
        self._note("buffers", sorted(captured), changed)

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


_INTERNAL = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(torch.__file__)))


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside lowdiff and torch (the user's forward call)."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level
