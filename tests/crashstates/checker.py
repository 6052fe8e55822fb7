"""Checking one crash state of a single-process workload (not a test module): resume reaches at
least the step reported durable before the crash, exactly, and later sessions lose nothing.

On each state, in the directory the workload wrote (absolute paths, such as the shared tier's in
``TIERS.json``, stay right):

1. ``recovery.resume`` into freshly built objects returns ``r >= required`` and the state is the
   uninterrupted run's at ``r``, byte for byte (its digest: model with buffers, optimizer, scheduler,
   sampler, RNG);
2. a session that wraps, resumes and closes without training (the store opens: inventory, clean-up
   of what the crash left) leaves a directory that still resumes to ``r``, exactly;
3. a session that trains on to ``steps + extra`` (full checkpoints, retention, drains) and closes
   leaves a directory that resumes there, exactly.
"""
from __future__ import annotations

import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from lowdiff_helpers import build, train_steps, wrap  # noqa: E402
from workload import Workload, directories, options  # noqa: E402

import recovery  # noqa: E402
from lowdiff.cli.demo import state_digest  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Outcome:
    """``kind``: "exact", "below" (resumed behind the durable step), "wrong" (another state),
    "error" (resume raised), "later" (a later session lost or broke something)."""
    kind: str
    resumed: int
    detail: str = ""


def resumed(work: Workload, root: str, reference: dict) -> tuple[int, str]:
    """(step, digest) of a resume into fresh objects, RNGs moved away first so that only what
    resume restores counts."""
    shared = directories(root)[1] if work.tiers else None
    for moved in (True, False):
        model, opt, sched, sampler = build()
        if moved:
            torch.manual_seed(4321)
            np.random.seed(4321)
        step = recovery.resume(directories(root)[0], model, opt, scheduler=sched, extra_state={"sampler": sampler},
                               shared_dir=shared)
        if step.full_step >= 0 or step > 0:
            break
        # Nothing was restored (no full checkpoint survived): training starts from the objects as
        # built, which is what the uninterrupted run's step 0 is; resume again without moving them.
    return int(step), state_digest(model, opt, sched, sampler)


def session(work: Workload, root: str, stop: int | None) -> int:
    """A later session: wrap, resume, train to ``stop`` (None: no step), close. The step it resumed."""
    model, opt, sched, sampler = build()
    opt = wrap(directories(root)[0], model, opt, sched, sampler, **options(work, root))
    try:
        start = int(recovery.resume(directories(root)[0], model, opt))
        if stop is not None:
            train_steps(model, opt, sched, sampler, start, stop)
    finally:
        opt.close()
    return start


def check(work: Workload, root: str, required: int, reference: dict) -> Outcome:
    try:
        step, digest = resumed(work, root, reference)
    except Exception as exc:  # every exception is a finding here: the state came from a power loss
        return Outcome("error", -1, f"resume raised {type(exc).__name__}: {exc}")
    if step < required:
        return Outcome("below", step, f"resumed at {step}, {required} was reported durable")
    if digest != reference[step]:
        return Outcome("wrong", step, f"resumed at {step} with a state unlike the uninterrupted run's")
    stop = work.steps + work.extra
    try:
        session(work, root, None)
        again, digest = resumed(work, root, reference)
        if again < step or digest != reference[again]:
            return Outcome("later", step, f"after a session that only opened and closed, resume gave {again} "
                                          f"({'exact' if digest == reference[again] else 'not exact'}), was {step}")
        session(work, root, stop)
        final, digest = resumed(work, root, reference)
        if final != stop or digest != reference[stop]:
            return Outcome("later", step, f"a later session trained to {stop}, resume then gave {final} "
                                          f"({'exact' if digest == reference.get(final) else 'not exact'})")
    except Exception as exc:
        return Outcome("later", step, f"a later session raised {type(exc).__name__}: {exc}")
    return Outcome("exact", step)
