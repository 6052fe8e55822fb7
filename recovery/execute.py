"""The one executor: carries out a frozen recovery plan (recovery.plan) for any layout.

For each candidate of the plan, in order: the layout loads its full state (the compatibility check
first, then the bytes, straight into the caller's tensors where they fit); a candidate whose files
fail to verify is skipped (warned, and the next one is tried); the first that loads is applied
(``apply_full``) and its differentials replayed up to the plan's target. Nothing here reads a
manifest: what to try, and whether the target is reachable, was decided by the plan.

A layout (recovery.restore.DirectoryLayout, recovery.partitioned.restore.PartitionedLayout) has
four methods, called in this order: ``load(plan, position, skipped)`` -> Loaded or None (it did
not verify: the reason appended to ``skipped``, warned); ``replay(plan, candidate, loaded, params,
optimizer, times)`` -> (last step, its record); ``release(loaded)`` after the replay, whatever
happened; ``none_verifies(plan, skipped)`` -> the error raised when no candidate loaded.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from lowdiff.errors import NoCheckpointError
from lowdiff.format.records import StepRecord
from lowdiff.format.schema import FullIndex, FullState, StepState
from recovery.pipeline.replay import ReplayTimes
from recovery.plan import Candidate, Loaded, Plan, warn


@dataclasses.dataclass(frozen=True)
class Restored:
    directory: str
    step: int                  # completed steps of the restored state
    full_step: int             # the full checkpoint it was rebuilt from
    full_index: FullIndex
    full_state: FullState
    last_record: StepRecord | None  # the record of ``step`` (None when step == full_step)
    skipped: tuple = ()        # (file, why) of newer full checkpoints that were not used
    full_file: str = ""        # the full checkpoint's file name
    newest_step: int = -1      # the newest step the directory's files reach
    load_s: float = 0.0        # reading and verifying the full checkpoint
    times: ReplayTimes = dataclasses.field(default_factory=ReplayTimes)

    @property
    def boundary(self) -> StepState:
        """The small state at the iteration boundary of ``step`` (RNG, extra_state, buffers,
        scheduler, GradScaler): from the last replayed record, or the full checkpoint's own."""
        if self.last_record is not None:
            return StepState.from_objects(self.directory, self.last_record.objects, f"record of step {self.step}")
        state = self.full_state
        return StepState([], [], state.rng, {}, state.extra, state.scheduler, state.grad_scaler)


class Layout(Protocol):
    def load(self, plan: Plan, position: int, skipped: list) -> Loaded | None: ...

    def replay(self, plan: Plan, candidate: Candidate, loaded: Loaded, params: list, optimizer,
               times: ReplayTimes) -> tuple: ...

    def release(self, loaded: Loaded) -> None: ...

    def none_verifies(self, plan: Plan, skipped: list) -> Exception: ...


def execute(plan: Plan, layout: Layout, *, apply_full, params_for, optimizer_for) -> tuple[Restored | None, bool]:
    """Carry ``plan`` out (see the module doc): (what was restored, None when the plan has no
    candidate; whether this rank got its own per-rank state back). ``apply_full(index, state)``
    loads a full state into the caller's objects; ``params_for(index)``/``optimizer_for(index)``
    are what the replay steps. Closes the plan's files."""
    skipped = list(plan.skipped)
    try:
        for position, candidate in enumerate(plan.candidates):
            started = time.perf_counter()
            loaded = layout.load(plan, position, skipped)
            if loaded is None:
                continue
            load_s = time.perf_counter() - started
            times = ReplayTimes()
            try:
                apply_full(loaded.index, loaded.state)
                step, last = layout.replay(plan, candidate, loaded, params_for(loaded.index),
                                           optimizer_for(loaded.index), times)
            finally:
                layout.release(loaded)
            if skipped:
                warn(f"lowdiff: resumed from the older full checkpoint of step {candidate.step}")
            if plan.target is not None and step != plan.target:
                # The plan found the target reachable by the manifests; a record on the way failed
                # to verify (replay warned which) and the objects hold the last step that did.
                raise NoCheckpointError(f"{plan.directory}: step {plan.target} cannot be rebuilt; the newest "
                                        f"reachable is {step}")
            return Restored(plan.directory, step, candidate.step, loaded.index, loaded.state, last, tuple(skipped),
                            loaded.file, plan.newest_step, load_s, times), loaded.own
    finally:
        plan.close()
    if skipped:
        raise layout.none_verifies(plan, skipped)
    return None, True
