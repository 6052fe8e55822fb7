"""Finding the newest state that verifies and rebuilding it: a frozen recovery plan first, then
its execution. Shared by ``resume`` (into live objects) and ``export`` (into fresh ones).

``plan_recovery`` touches no live object: it reconciles the manifest with the directory, picks the
newest full checkpoint at or before the target that verifies and is what its entry says, lets the
caller check that it fits the caller's objects, and opens every batch file of its chain (an open
file survives a live trainer's retention). ``execute`` then loads it into the caller's objects and
replays the chain.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

from lowdiff.errors import CorruptCheckpointError, DirectoryBusyError, NoCheckpointError, VersionMismatchError
from lowdiff.format.batchfile import BatchReader
from lowdiff.format.fullckpt import load_full
from lowdiff.format.records import StepRecord
from lowdiff.format.schema import FullIndex, FullState, StepState
from lowdiff.store.inventory import check_entry, take_inventory
from lowdiff.store.manifest import MANIFEST_NAME, BatchEntry, FullEntry, chain_end, describe_retained, plan_chain
from recovery.replay import ReplayTimes, replay

log = logging.getLogger("lowdiff")
_ATTEMPTS = 5   # re-reads of the directory when a live trainer's retention moved a file away


def warn(message: str) -> None:
    log.warning(message)


@dataclasses.dataclass(frozen=True)
class RecoveryPlan:
    """What recovery will do, decided before any live object changes."""

    directory: str
    full: FullEntry            # the full checkpoint to start from
    index: FullIndex
    state: FullState           # its contents, verified
    chain: tuple               # (BatchEntry, open BatchReader) continuing it, in step order
    stop_step: int | None      # the target, None for the newest
    skipped: tuple             # (file, why) of newer files that were not used
    newest_step: int           # the newest step the directory's files reach (what resuming earlier abandons)
    load_s: float              # time spent reading and verifying the full checkpoint

    def close(self) -> None:
        for _, reader in self.chain:
            reader.close()


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


class _Moved(Exception):
    """A listed file vanished and the manifest changed meanwhile: start again from a fresh view."""


def checkpoint_directory(directory) -> str:
    """``directory`` as a path; a path that is a file is refused by name."""
    if not isinstance(directory, (str, bytes, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"{directory} is a file, not a checkpoint directory")
    return directory


def restore(directory: str, *, check_full, apply_full, params_for, optimizer_for,
            stop_step: int | None = None, workers: int | None = None, into=None) -> Restored | None:
    """Plan (``plan_recovery``), then execute: returns None for a directory with nothing in it."""
    plan = plan_recovery(directory, check_full=check_full, stop_step=stop_step, into=into)
    if plan is None:
        return None
    return execute(plan, apply_full=apply_full, params_for=params_for, optimizer_for=optimizer_for, workers=workers)


def plan_recovery(directory: str, *, check_full, stop_step: int | None = None, into=None) -> RecoveryPlan | None:
    """The plan to rebuild the newest durable state (or the one at ``stop_step``).

    ``check_full(path, index, state)`` raises if the checkpoint does not fit the caller's objects.
    ``into()`` gives the live tensors a full checkpoint is read straight into (``load_full``):
    the caller's own model, which a plan that raises may leave holding part of a checkpoint.
    Falls back to older full checkpoints when a newer one does not verify. None for a directory
    with nothing in it; NoCheckpointError when nothing verifies or ``stop_step`` is not retained.
    """
    directory = checkpoint_directory(directory)
    if not os.path.isdir(directory):
        return None
    for _ in range(_ATTEMPTS):
        try:
            return _plan_once(directory, check_full, stop_step, into)
        except _Moved:
            continue
    raise DirectoryBusyError(f"{directory}: checkpoint files kept disappearing while they were read "
                             f"(a live trainer's retention); try again")


def execute(plan: RecoveryPlan, *, apply_full, params_for, optimizer_for, workers: int | None = None) -> Restored:
    """Load the plan's full checkpoint with ``apply_full(index, state)`` and replay its chain with
    ``params_for(index)``/``optimizer_for(index)`` and ``workers`` decoding threads. Closes the
    plan's files."""
    times = ReplayTimes()
    try:
        apply_full(plan.index, plan.state)
        step, last = replay(list(plan.chain), plan.full.step, params_for(plan.index), optimizer_for(plan.index),
                            stop_step=plan.stop_step, warn=warn, times=times, workers=workers)
    finally:
        plan.close()
    if plan.skipped:
        warn(f"lowdiff: resumed from the older full checkpoint of step {plan.full.step}")
    if plan.stop_step is not None and step != plan.stop_step:
        raise NoCheckpointError(f"{plan.directory}: step {plan.stop_step} cannot be rebuilt; the newest "
                                f"reachable is {step}")
    return Restored(plan.directory, step, plan.full.step, plan.index, plan.state, last, plan.skipped,
                    plan.full.file, plan.newest_step, plan.load_s, times)


def _plan_once(directory, check_full, stop_step, into):
    inventory = take_inventory(directory, skip_other_versions=stop_step is not None)
    for note in inventory.notes:
        warn(f"lowdiff: {note}")
    manifest = inventory.manifest
    if stop_step is not None and not manifest.retains(stop_step):
        raise NoCheckpointError(f"{directory}: step {stop_step} is not retained; {describe_retained(manifest)}")
    fulls = sorted((f for f in manifest.fulls if stop_step is None or f.step <= stop_step),
                   key=lambda f: f.step, reverse=True)
    skipped: list = []
    for full in fulls:
        started = time.perf_counter()
        loaded = _load_verified(directory, inventory, full, stop_step, skipped, into, check_full)
        if loaded is None:
            continue
        load_s = time.perf_counter() - started
        index, state = loaded
        chain = _open_chain(directory, inventory, full.step, stop_step)
        reach = chain_end(manifest, full.step, [entry for entry, _ in chain])
        if stop_step is not None and reach < stop_step:
            _close_all(chain)
            raise NoCheckpointError(f"{directory}: step {stop_step} cannot be rebuilt: the files after the full "
                                    f"checkpoint of step {full.step} reach only step {reach}")
        return RecoveryPlan(directory, full, index, state, tuple(chain), stop_step, tuple(skipped),
                            manifest.durable_step(), load_s)
    if skipped or manifest.batches:
        raise NoCheckpointError(f"{directory}: no full checkpoint verifies" +
                                (f" at or before step {stop_step}" if stop_step is not None else "") +
                                (": " + "; ".join(why for _, why in skipped) if skipped else ""))
    return None


def _load_verified(directory, inventory, full, stop_step, skipped: list, into, check_full):
    """(index, state) of ``full`` if it verifies and is what its entry says; else None, with the
    reason appended to ``skipped`` and logged."""
    path = os.path.join(directory, full.file)
    try:
        def check(index, outline) -> None:
            # Whether the file is what its entry says, and fits the caller's objects, is known from
            # its index and outline: both are checked before anything is read into the live model.
            check_entry(path, full, index, os.path.getsize(path), inventory.manifest.run)
            check_full(path, index, outline)
        return load_full(path, into=into() if into is not None else None, check=check)
    except FileNotFoundError:
        _raise_if_moved(directory, inventory)
        why = f"{path} is missing"
    except VersionMismatchError as exc:
        if stop_step is None:
            raise
        why = f"{exc} (skipped: an older state was asked for)"
    except (CorruptCheckpointError, OSError, EOFError) as exc:
        why = f"full checkpoint {path} does not verify ({exc})"
    skipped.append((full.file, why))
    warn(f"lowdiff: {why}; falling back to an older one")
    return None


def _open_chain(directory: str, inventory, base_step: int, stop_step: int | None) -> list:
    """[(entry, open BatchReader)] continuing ``base_step`` (up to ``stop_step``). The chain ends
    before a batch that is missing or is not what its entry says (with a warning); a batch whose
    index is damaged (a torn or truncated file) still gives the records that verify."""
    chain: list[tuple[BatchEntry, BatchReader]] = []
    try:
        for entry in plan_chain(inventory.manifest, base_step):
            if stop_step is not None and entry.first > stop_step:
                break
            reader = _open_batch(directory, inventory, entry, base_step, stop_step)
            if reader is None:
                break
            chain.append((entry, reader))
    except BaseException:   # e.g. _Moved: a live trainer retired a file; the caller starts again
        _close_all(chain)
        raise
    return chain


def _open_batch(directory, inventory, entry, base_step, stop_step):
    path = os.path.join(directory, entry.file)
    ends = f"the chain from step {base_step} ends at step {entry.first - 1}"
    try:
        reader = BatchReader(path)
    except FileNotFoundError:
        _raise_if_moved(directory, inventory)
        warn(f"lowdiff: {path} is missing; {ends}")
        return None
    except VersionMismatchError as exc:
        if stop_step is None:
            raise   # (_open_chain closes what it opened)
        warn(f"lowdiff: {exc}; {ends}")
        return None
    except (CorruptCheckpointError, OSError, EOFError) as exc:
        warn(f"lowdiff: {exc}; {ends}")
        return None
    if reader.index is not None:  # without one, replay checks each record's step and checksum
        try:
            check_entry(path, entry, reader.index, reader.size, inventory.manifest.run)
        except CorruptCheckpointError as exc:
            reader.close()
            warn(f"lowdiff: {exc}; {ends}")
            return None
    return reader


def _close_all(chain: list) -> None:
    for _, reader in chain:
        reader.close()


def _raise_if_moved(directory: str, inventory) -> None:
    """A listed file is gone: if the manifest changed since the view was taken, a live trainer
    moved on (retention) and the caller starts again; otherwise the file is really missing."""
    try:
        with open(os.path.join(directory, MANIFEST_NAME), "rb") as f:
            now = f.read()
    except FileNotFoundError:
        now = None
    if now != inventory.committed:
        raise _Moved()
