"""The single-directory layout: its frozen plan (``plan_directory``) and how ``recovery.execute``
reads its files (``DirectoryLayout``). Shared by ``resume`` (into live objects) and ``export``
(into fresh ones).

Planning touches no live object: it reconciles the manifest with the directory, refuses a target
step the manifest does not retain, lists the full checkpoints at or before the target newest first
(the fallback order), and for the first whose header is what its entry says and fits the caller's
objects (``check_full``, on the state's outline) opens every batch file of its chain (an open file
survives a live trainer's retention) and checks that the chain reaches the target. Executing reads
the full checkpoint's payload straight into the caller's tensors, every checksum checked, and
replays the chain; a payload that fails to verify makes the executor prepare the next candidate
the same way.
"""
from __future__ import annotations

import os

import torch

import fastio
from lowdiff.errors import CorruptCheckpointError, DirectoryBusyError, NoCheckpointError, VersionMismatchError
from lowdiff.format import container, tree
from lowdiff.format.batchfile import BatchReader
from lowdiff.format.fullckpt import load_full
from lowdiff.format.records import dtype_from_name
from lowdiff.format.schema import FullIndex, FullState
from lowdiff.store.inventory import check_entry, take_inventory
from lowdiff.store.manifest import MANIFEST_NAME, BatchEntry, chain_end, describe_retained, entry_path, plan_chain
from lowdiff.store.stripes import check_batch_device
from recovery.execute import Restored, execute
from recovery.pipeline.replay import ReplayPipeline, replay
from recovery.plan import Candidate, Loaded, Plan, checkpoint_directory, warn

__all__ = ["DirectoryLayout", "Restored", "checkpoint_directory", "execute_directory", "plan_directory",
           "planned_step", "restore", "warn"]

_ATTEMPTS = 5   # re-reads of the directory when a live trainer's retention moved a file away


class _Moved(Exception):
    """A listed file vanished and the manifest changed meanwhile: start again from a fresh view."""


def restore(directory: str, *, check_full, apply_full, params_for, optimizer_for,
            stop_step: int | None = None, workers: int | None = None, into=None,
            early_params=None) -> Restored | None:
    """Plan (``plan_directory``), then execute (recovery.execute): None for a directory with nothing
    in it. ``into()`` gives the live tensors a full checkpoint is read straight into.
    ``early_params()``: the parameters the replay steps, where they are known before a full
    checkpoint is loaded (resume's are the live ones): the chain's first records are then read and
    decoded while the full checkpoint loads."""
    for _ in range(_ATTEMPTS):
        plan = plan_directory(directory, check_full=check_full, stop_step=stop_step)
        if plan is None:
            return None
        try:
            return _execute(plan, check_full, apply_full, params_for, optimizer_for, workers, into, early_params)
        except _Moved:   # a fallback's file was retired meanwhile: plan again from a fresh view
            continue
    raise _busy(directory)


def execute_directory(plan: Plan, *, check_full, apply_full, params_for, optimizer_for, workers=None,
                      into=None, early_params=None) -> Restored | None:
    """Carry out a plan of ``plan_directory``; if a live trainer retired a fallback's file
    meanwhile, plan again from a fresh view (``restore``)."""
    try:
        return _execute(plan, check_full, apply_full, params_for, optimizer_for, workers, into, early_params)
    except _Moved:
        return restore(plan.directory, check_full=check_full, apply_full=apply_full, params_for=params_for,
                       optimizer_for=optimizer_for, stop_step=plan.target, workers=workers, into=into,
                       early_params=early_params)


def _execute(plan: Plan, check_full, apply_full, params_for, optimizer_for, workers, into,
             early_params=None) -> Restored:
    restored, _ = execute(plan, DirectoryLayout(check_full, into, workers, early_params), apply_full=apply_full,
                          params_for=params_for, optimizer_for=optimizer_for)
    assert restored is not None   # a plan has a candidate; when none loads, the layout raises
    return restored


def planned_step(plan: Plan | None) -> int:
    """The step ``plan`` reaches if its files verify: the target, else the end of the first
    candidate's opened chain (0 for no plan)."""
    if plan is None:
        return 0
    if plan.target is not None:
        return plan.target
    return chain_end(plan.view.manifest, plan.candidates[0].step, [entry for entry, _ in plan.opened])


def plan_directory(directory: str, *, check_full, stop_step: int | None = None) -> Plan | None:
    """The frozen plan to rebuild the newest durable state (or the one at ``stop_step``), decided
    before any live object changes (see the module doc). ``check_full(path, index, outline)``
    raises if a checkpoint does not fit the caller's objects. None for a directory with nothing in
    it; NoCheckpointError when nothing verifies, or ``stop_step`` is not retained or cannot be
    reached."""
    directory = checkpoint_directory(directory)
    if not os.path.isdir(directory):
        return None
    for _ in range(_ATTEMPTS):
        try:
            return _plan_once(directory, check_full, stop_step)
        except _Moved:
            continue
    raise _busy(directory)


def _busy(directory: str) -> DirectoryBusyError:
    return DirectoryBusyError(f"{directory}: checkpoint files kept disappearing while they were read "
                              f"(a live trainer's retention); try again")


def _plan_once(directory: str, check_full, stop_step: int | None) -> Plan | None:
    inventory = take_inventory(directory, skip_other_versions=stop_step is not None)
    for note in inventory.notes:
        warn(f"lowdiff: {note}")
    manifest = inventory.manifest
    if stop_step is not None and not manifest.retains(stop_step):
        raise NoCheckpointError(f"{directory}: step {stop_step} is not retained; {describe_retained(manifest)}")
    fulls = sorted((f for f in manifest.fulls if stop_step is None or f.step <= stop_step),
                   key=lambda f: f.step, reverse=True)
    candidates = [Candidate(f.step, f, chain_end(manifest, f.step, plan_chain(manifest, f.step))) for f in fulls]
    skipped: list = []
    for position, candidate in enumerate(candidates):
        chain = _prepare(directory, inventory, candidate, stop_step, skipped, check_full)
        if chain is not None:
            return Plan("directory", directory, stop_step, tuple(candidates[position:]), manifest.durable_step(),
                        tuple(skipped), tuple(chain), inventory)
    if not (skipped or manifest.fulls or inventory.missing or inventory.superseded or inventory.ignored) \
            and stop_step is None:
        if manifest.batches:
            # No full checkpoint was ever listed or found, none is missing or damaged: the run
            # stopped (a crash, a power loss) before its first full checkpoint was renamed into
            # place, while the batch writer had committed differentials that need it. Nothing of
            # it was durable: there is nothing to resume (and nothing lost).
            warn(f"lowdiff: {directory} holds differential batches but no full checkpoint was ever committed "
                 f"(the run stopped before its first one): nothing to resume, training starts at step 0")
        return None
    if skipped or manifest.batches:
        raise _none_verifies(directory, stop_step, skipped)
    return None


def _none_verifies(directory: str, stop_step: int | None, skipped: list) -> NoCheckpointError:
    return NoCheckpointError(f"{directory}: no full checkpoint verifies" +
                             (f" at or before step {stop_step}" if stop_step is not None else "") +
                             (": " + "; ".join(why for _, why in skipped) if skipped else ""))


def _prepare(directory: str, inventory, candidate: Candidate, stop_step: int | None, skipped: list, check_full):
    """The open chain of ``candidate`` if its header is what its entry says and fits the caller's
    objects; else None (why appended to ``skipped``, warned). Refuses a ``stop_step`` its chain's
    files do not reach, unless the full checkpoint itself does not verify (then it is skipped, and
    an older one may reach the target): the payload is read for that into memory of its own, not
    into the caller's tensors."""
    full = candidate.source
    check = _checker(directory, inventory, full, check_full)
    if _verified(directory, inventory, full, stop_step, skipped, lambda path: _read_header(path, check)) is None:
        return None
    chain = _open_chain(directory, inventory, full.step, stop_step)
    reach = chain_end(inventory.manifest, full.step, [entry for entry, _ in chain])
    if stop_step is not None and reach < stop_step:
        _close_all(chain)
        if _verified(directory, inventory, full, stop_step, skipped, lambda path: load_full(path, check=check)) \
                is None:
            return None
        raise NoCheckpointError(f"{directory}: step {stop_step} cannot be rebuilt: the files after the full "
                                f"checkpoint of step {full.step} reach only step {reach}")
    return chain


def _checker(directory: str, inventory, full, check_full):
    def check(index, outline) -> None:
        # Whether the file is what its entry says, and fits the caller's objects, is known from
        # its index and outline: both are checked before anything is read into the live model.
        path = os.path.join(directory, full.file)
        check_entry(path, full, index, os.path.getsize(path), inventory.manifest.run)
        check_full(path, index, outline)
    return check


def _read_header(path: str, check) -> tuple:
    """A full checkpoint's index and objects section, checksum checked, and ``check(index,
    outline)`` (as ``load_full``'s) called; its payload is not read."""
    with fastio.Reader(path) as reader:
        index = FullIndex.from_json(path, container.read_index(path, reader.read, reader.size, container.KIND_FULL),
                                    reader.size)
        objects = reader.read(index.objects.offset, index.objects.nbytes)
    entry = index.objects
    if (fastio.crc32c(objects) != entry.crc32c) if entry.crc32c is not None else \
            (fastio.crc32(objects) != entry.crc32):
        raise CorruptCheckpointError(path, f"objects section at offset {entry.offset} fails its checksum")
    outline = {e.key: torch.empty(e.shape, dtype=dtype_from_name(e.dtype, path), device="meta")
               for e in index.tensors}

    def lookup(key):
        if key not in outline:
            raise CorruptCheckpointError(path, f"index has no tensor {key!r}")
        return outline[key]
    check(index, FullState.from_tree(path, tree.join_tensors(tree.loads(objects, path), lookup)))
    return index, None


def _verified(directory, inventory, full, stop_step, skipped: list, read):
    """``read(path)`` of ``full``'s file if it verifies and is what its entry says; else None, with
    the reason appended to ``skipped`` and logged."""
    path = os.path.join(directory, full.file)
    try:
        return read(path)
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


class DirectoryLayout:
    """How recovery.execute reads a single directory's files (``into()``: the live tensors a full
    checkpoint is read straight into; ``workers``: the replay's decoding threads; ``early_params()``:
    the replay's parameters, when known before the load, to start decoding records during it)."""

    def __init__(self, check_full, into, workers: int | None, early_params=None):
        self._check_full = check_full
        self._into = into
        self._workers = workers
        self._early_params = early_params

    def load(self, plan: Plan, position: int, skipped: list) -> Loaded | None:
        candidate, inventory = plan.candidates[position], plan.view
        chain = list(plan.opened) if position == 0 else \
            _prepare(plan.directory, inventory, candidate, plan.target, skipped, self._check_full)
        if chain is None:
            return None
        full = candidate.source
        check = _checker(plan.directory, inventory, full, self._check_full)
        early = None
        try:
            if self._early_params is not None and chain:
                early = ReplayPipeline(list(chain), candidate.step, self._early_params(), stop_step=plan.target,
                                       warn=warn, workers=self._workers)
            loaded = _verified(plan.directory, inventory, full, plan.target, skipped, lambda path: load_full(
                path, into=self._into() if self._into is not None else None, check=check))
        except BaseException:
            _close_early(early)
            _close_all(chain)
            raise
        if loaded is None:
            _close_early(early)
            _close_all(chain)
            return None
        return Loaded(loaded[0], loaded[1], full.file, tuple(chain), replay=early)

    def replay(self, plan: Plan, candidate: Candidate, loaded: Loaded, params: list, optimizer, times) -> tuple:
        if loaded.replay is None:
            return replay(list(loaded.chain), candidate.step, params, optimizer, stop_step=plan.target, warn=warn,
                          times=times, workers=self._workers)
        try:
            return loaded.replay.run(optimizer)
        finally:
            _merge_times(times, loaded.replay.times)

    def release(self, loaded: Loaded) -> None:
        _close_early(loaded.replay)
        _close_all(loaded.chain)

    def none_verifies(self, plan: Plan, skipped: list) -> Exception:
        return _none_verifies(plan.directory, plan.target, skipped)


def _close_early(pipeline: ReplayPipeline | None) -> None:
    if pipeline is not None:
        pipeline.close()


def _merge_times(into, times) -> None:
    """The early replay's timings, into the ``ReplayTimes`` execute keeps for this candidate."""
    into.read_s += times.read_s
    into.decode_s += times.decode_s
    into.apply_s += times.apply_s
    into.wall_s += times.wall_s
    into.records += times.records
    into.workers = times.workers


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
    path = entry_path(directory, entry)   # (a batch on another drive: there)
    check_batch_device(directory, entry)  # a drive not mounted is refused by name, never "missing"
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


def _close_all(chain) -> None:
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
