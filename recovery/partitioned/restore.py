"""recovery.partitioned.restore: resuming a partitioned directory (docs/format.md, "Partitioned
directories") at any world size: its frozen plan and how recovery.execute reads its files.

Planning: rank 0 surveys the rank directories (recovery.partitioned.plan) and sends what it found to
every rank, the one point where the ranks agree; every rank then checks the target step against it
alike, before any live object changes, so all ranks try the same sets in the same order. Executing:
each set is read with recovery.partitioned.load (the ranks agree on which shares failed, and fall
back together to an older set when one did); the differential shares continuing it are read by
rank ``i mod W`` for share i and sent to the others (recovery.partitioned.chain joins them). Every
rank ends with the same bytes, so replay gives the same state on all. Without a process group
(W = 1) the same code reads everything itself.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from lowdiff.distributed.dtensors import LocalGradTarget
from lowdiff.distributed.partition import missing_directory_error
from lowdiff.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError, VersionMismatchError
from lowdiff.format.schema import FullIndex
from lowdiff.format.sharefile import read_diff_share_index
from recovery.execute import Restored, execute
from recovery.partitioned.chain import MergedShares, ShareFiles, chain_reach
from recovery.partitioned.load import full_index, load_set, reads_of
from recovery.partitioned.plan import LOCAL, FullSet, LocalFiles, broadcast_plan
from recovery.pipeline.replay import replay
from recovery.plan import Candidate, Loaded, Plan, warn

# Records in flight in a partitioned replay. The same on every rank whatever its cores: the files
# behind them are fetched collectively, so every rank must fetch as many before the replay stops.
REPLAY_WINDOW = 8


def _exchange_indexes(root: str, fset: FullSet, rank: int, world: int, files: LocalFiles = LOCAL) -> list:
    """[ShareFiles] of every share, with its files' indexes (rank ``i mod world`` reads share i's
    and sends them; a file whose index cannot be read ends that share's list, with the reason).
    Only the indexes are read (``files.index_reader``): a file fetched from a bucket arrives
    whole when the replay reaches it."""
    shares = []
    for i, names in enumerate(fset.chains):
        reader_rank = i % world
        listed: list = []
        if reader_rank == rank:
            for position in range(len(names)):
                path = fset.chain_path(root, i, position)   # (on another drive: there)
                try:
                    with files.index_reader(path) as reader:
                        listed.append((path, read_diff_share_index(path, reader)))
                except VersionMismatchError as exc:   # not damage: raised on every rank below
                    listed.append((path, ("version", exc.problem)))
                    break
                except CorruptCheckpointError as exc:
                    listed.append((path, str(exc)))
                    break
                except OSError as exc:
                    listed.append((path, f"{path} cannot be read ({exc})"))
                    break
        if world > 1:
            sent = [listed]
            dist.broadcast_object_list(sent, src=reader_rank)
            listed = sent[0]
        for path, index in listed:
            if isinstance(index, tuple):
                raise VersionMismatchError(path, index[1])
        shares.append(ShareFiles(i, tuple(listed)))
    return shares


def _fetcher(shares: list, rank: int, world: int, files: LocalFiles = LOCAL):
    """sharechain's ``fetch``: rank ``share mod world`` reads the file and sends it to the others
    (a collective: every rank calls it for the same files in the same order)."""
    def fetch(share: int, position: int):
        path = shares[share].files[position][0]
        reader_rank = share % world
        data = None
        if reader_rank == rank:
            try:
                data = _read_whole(files.ready(path))
            except (CheckpointError, OSError) as exc:
                warn(f"lowdiff: {path} cannot be read ({exc}); the chain of share {share} ends before it")
        if world > 1:
            size = [-1 if data is None else data.numel()]
            dist.broadcast_object_list(size, src=reader_rank)
            if reader_rank != rank and size[0] >= 0:
                data = torch.empty(size[0], dtype=torch.uint8)
            if data is not None and data.numel():
                dist.broadcast(data, src=reader_rank)   # received in place: the only copy of the file
        return None if data is None else data.numpy()
    return fetch


def _read_whole(path: str) -> torch.Tensor:
    """The file's bytes in one uint8 tensor: read into it (no intermediate bytes object), sent over
    the process group from it, and decoded from it (replay decodes each record's values as views)."""
    with open(path, "rb", buffering=0) as f:
        data = torch.empty(os.fstat(f.fileno()).st_size, dtype=torch.uint8)
        view, got = data.numpy().data, 0   # a writable memoryview of the tensor
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise OSError(f"{path} ended after {got} of {len(view)} bytes while being read")
            got += n
    return data


def _note_world_change(fset: FullSet, rank: int, world: int) -> None:
    if rank == 0 and world < fset.count:
        warn(f"lowdiff: the full checkpoint of step {fset.step} was written by {fset.count} ranks and {world} "
             f"resume it: the per-rank state of ranks {world}..{fset.count - 1} (RNG, extra_state, error-feedback "
             f"residuals) is dropped")
    if rank >= fset.count:
        warn(f"lowdiff: rank {rank} did not exist when step {fset.step} was saved by {fset.count} ranks: it gets "
             f"rank 0's buffers and scheduler state, keeps its own RNG and extra_state as they were before resume, "
             f"and starts with zero error-feedback residuals")


def _replay_chain(root: str, fset: FullSet, index: FullIndex, rank: int, world: int, *, params, optimizer,
                  stop_step, workers, times, as_share: int | None = None, files: LocalFiles = LOCAL):
    """Exchange and replay the differential shares continuing ``fset``: (last step, its record)."""
    shares = _exchange_indexes(root, fset, rank, world, files)
    try:
        live = {slot: p.param for slot, p in enumerate(params) if isinstance(p, LocalGradTarget)}
        own = as_share if as_share is not None else rank if rank < fset.count else None
        merged = MergedShares(root, shares, fset.step, len(index.param_names), own, warn,
                              _fetcher(shares, rank, world, files), live, own_chunks=as_share is not None)
    except CorruptCheckpointError as exc:   # every rank decodes the same bytes: all stop here
        warn(f"lowdiff: {exc}; resuming at step {fset.step}, the full checkpoint's step")
        return fset.step, None
    try:
        return replay([(merged.entry(), merged)], fset.step, params, optimizer, stop_step=stop_step, warn=warn,
                      times=times, workers=workers, window=REPLAY_WINDOW)
    finally:
        merged.close()


def _process_group() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def plan_partitioned(root: str, *, check_full, stop_step: int | None = None, files: LocalFiles = LOCAL) -> Plan:
    """The frozen plan of the partitioned directory ``root`` (at or before ``stop_step``), the same
    on every rank (see the module doc). Refuses, before any live object changes: rank directories
    that the sets need and that are absent, a ``stop_step`` no complete set reaches by the
    manifests, and one that the first set to verify (the one a resume would take) does not reach
    by the manifests or by its differential files' indexes (exchanged as the replay does; no record
    is read). Such a set is read for that into memory of its own (a collective), not into the
    caller's tensors; one that does not verify is skipped, as the executor would. ``files``: how
    the files are reached (LocalFiles)."""
    rank, world = _process_group()
    found = broadcast_plan(root, stop_step, world, files)
    if found.missing:   # (on every rank alike: the plan is rank 0's)
        raise missing_directory_error(root, found.missing)
    if stop_step is not None and not any(first <= stop_step <= last for first, last in found.ranges):
        raise NoCheckpointError(f"{root}: step {stop_step} is not retained; {found.retained}")
    candidates = [Candidate(fset.step, fset, fset.reach) for fset in found.sets]
    skipped: list = []
    while stop_step is not None and candidates:
        fset = candidates[0].source
        notes: list = []
        reach = fset.reach if fset.reach < stop_step else \
            chain_reach(_exchange_indexes(root, fset, rank, world, files), fset.step, notes.append)
        if reach >= stop_step:
            break
        candidates.pop(0)
        files.expect(fset, reads_of(fset, rank, world))
        if load_set(fset, rank, world, check_full, None, files=files) is not None:
            for note in notes:   # why the files end early (the replay would have said it)
                warn(note)
            raise NoCheckpointError(f"{root}: step {stop_step} cannot be rebuilt; the newest reachable is {reach}")
        skipped.append(_skipped(fset))
    return Plan("partitioned", root, stop_step, tuple(candidates), found.newest, tuple(skipped))


def _skipped(fset: FullSet) -> tuple:
    return os.path.basename(fset.files[0]), f"a share of the full checkpoint of step {fset.step} does not verify"


class PartitionedLayout:
    """How recovery.execute reads a partitioned directory's files on this rank (``into()``: the
    live tensors the shared state is read straight into; ``workers``: the replay's threads)."""

    def __init__(self, check_full, into, workers: int | None, as_share: int | None = None,
                 files: LocalFiles = LOCAL):
        self._as_share = as_share   # see load_set: one process exporting one share's chunks
        self._files = files
        self._check_full = check_full
        self._into = into
        self._workers = workers
        self._rank, self._world = _process_group()

    def load(self, plan: Plan, position: int, skipped: list) -> Loaded | None:
        fset = plan.candidates[position].source
        if self._as_share is not None and self._as_share >= fset.count:   # an older set, of fewer ranks
            skipped.append((os.path.basename(fset.files[0]), f"the set of step {fset.step} has no share "
                                                             f"{self._as_share} ({fset.count} shares)"))
            return None
        self._files.expect(fset, reads_of(fset, self._rank, self._world, self._as_share))
        loaded = load_set(fset, self._rank, self._world, self._check_full, self._into, self._as_share, self._files)
        if loaded is None:
            skipped.append(_skipped(fset))
            return None
        own = self._rank < fset.count or self._as_share is not None
        state = loaded.state if own else dataclasses.replace(loaded.state, rng={}, extra={}, residuals={})
        if self._as_share is None:
            _note_world_change(fset, self._rank, self._world)
        return Loaded(full_index(loaded.index), state, loaded.path, (), own)

    def replay(self, plan: Plan, candidate: Candidate, loaded: Loaded, params: list, optimizer, times) -> tuple:
        return _replay_chain(plan.directory, candidate.source, loaded.index, self._rank, self._world, params=params,
                             optimizer=optimizer, stop_step=plan.target, workers=self._workers, times=times,
                             as_share=self._as_share, files=self._files)

    def release(self, loaded: Loaded) -> None:
        pass   # _replay_chain closes the chain it fetched

    def none_verifies(self, plan: Plan, skipped: list) -> Exception:
        return NoCheckpointError(f"{plan.directory}: no complete full checkpoint verifies: " +
                                 "; ".join(w for _, w in skipped))


def restore_partitioned(root: str, *, check_full, apply_full, params_for, optimizer_for, stop_step=None,
                        workers=None, into=None, as_share: int | None = None,
                        files: LocalFiles = LOCAL) -> tuple[Restored | None, bool]:
    """Restore the newest state of the partitioned directory ``root`` (at or before ``stop_step``),
    on every rank of the process group alike: ``plan_partitioned``, then recovery.execute. Returns
    (what was restored, or None when no complete set exists; whether this rank got its own
    per-rank state back). Callbacks and ``into`` as recovery.restore; ``as_share`` as load_set;
    ``files``: how the files are reached (recovery.partitioned.plan.LocalFiles)."""
    plan = plan_partitioned(root, check_full=check_full, stop_step=stop_step, files=files)
    return execute(plan, PartitionedLayout(check_full, into, workers, as_share, files), apply_full=apply_full,
                   params_for=params_for, optimizer_for=optimizer_for)
