"""recovery.partitioned.plan: which full sets of a partitioned directory a resume may start from,
newest first, surveyed by rank 0 from the reconciled view of every rank directory and sent to every
rank (recovery.partitioned.restore makes the frozen plan of it; recovery.execute carries it out)."""
from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

import fastio
from lowdiff.distributed.partition import (
    describe_ranges,
    full_sets,
    missing_rank_directories,
    rank_directory,
    read_views,
    retained_ranges,
    session_chain,
)
from lowdiff.errors import CheckpointError, MissingDeviceError
from lowdiff.store.stripes import check_devices
from recovery.plan import warn


class LocalFiles:
    """A partitioned directory's files as they are on disk: how recovery reaches them by default.
    recovery.partitioned.bucket implements the same for a bucket, whose files arrive while the
    restore runs. Call order: ``views`` and ``count_of`` while rank 0 surveys; ``expect(fset,
    shares)`` before a set is loaded (the shares this rank reads, in that order); ``ready(path)``
    before a file is opened whole (the path to open: this rank's copy); ``index_reader(path)``
    for a file whose index alone is read (a context manager with ``read(offset, n)`` and
    ``size``). ``remote``: whether a rank holds only the files it reads (the ranks then exchange
    the full shares' indexes instead of each reading all)."""

    remote = False

    def views(self) -> dict | None:
        return None   # read from the rank directories

    def count_of(self, step: int, session: str) -> int | None:
        return None   # read from a share's index

    def expect(self, fset: FullSet, shares: list) -> None:
        pass

    def ready(self, path: str) -> str:
        return path

    def index_reader(self, path: str):
        return fastio.Reader(path)


LOCAL = LocalFiles()


@dataclasses.dataclass(frozen=True)
class FullSet:
    """A complete full set: share i is ``files[i]``; ``chains[i]`` the differential files of share
    i continuing it (names in ``rank-i/``); ``reach`` the step all its chains reach by the manifests;
    ``chain_dirs[i]``: the directory of each of them on another drive (a striped rank directory's
    stripe directory: docs/format.md, "More drives than ranks"), None where it is in the rank's own."""
    step: int
    session: str
    count: int
    files: tuple
    chains: tuple
    reach: int = -1
    chain_dirs: tuple = ()

    def chain_path(self, root: str, share: int, position: int) -> str:
        """Where file ``position`` of share ``share``'s chain is."""
        where = self.chain_dirs[share][position] if self.chain_dirs else None
        return os.path.join(where if where is not None else rank_directory(root, share), self.chains[share][position])


@dataclasses.dataclass(frozen=True)
class Survey:
    """What rank 0 found in the rank directories, sent to every rank (recovery.partitioned.restore
    makes the frozen recovery.plan.Plan of it)."""
    sets: list                 # FullSet at or before the asked step, newest first (ties: furthest reach)
    newest: int                # the newest step any rank directory lists
    ranges: list               # [(first, last)] steps the complete sets reach (time travel targets)
    retained: str              # the same, in words, for errors
    missing: dict = dataclasses.field(default_factory=dict)   # {rank: [steps]}: rank directories sets need, absent


def plan(root: str, stop_step: int | None, views: dict | None = None, count_of=None) -> Survey:
    """The complete full sets of the partitioned directory ``root`` (at or before ``stop_step``),
    from the reconciled view of every rank directory: a rank whose manifest is missing or damaged
    has its list rebuilt from its share files (warned), so no durable share is lost with it.
    ``views`` (lowdiff.distributed.partition.read_views): already taken, their notes reported by the caller;
    ``count_of(step, session)``: a set's share count, where its shares are not on disk."""
    if views is None:   # (files of another format version block only the newest state, as in recovery.restore)
        views = read_views(root, skip_other_versions=stop_step is not None)
        for inventory in views.values():
            for note in inventory.notes:
                warn(f"lowdiff: {note}")
    manifests = {rank: inventory.manifest for rank, inventory in views.items()}
    for rank, manifest in manifests.items():   # a striped share's drive not mounted: refused by name
        check_devices(rank_directory(root, rank), manifest)
    newest = max([b.last for m in manifests.values() for b in m.batches] +
                 [f.step for m in manifests.values() for f in m.fulls], default=-1)
    every = full_sets(root, manifests, count_of)
    sets: list[FullSet] = []
    for fset in reversed(every):
        if stop_step is not None and fset.step > stop_step:
            continue
        # A set older than a complete one is passed over, not fallen back from: an incomplete one
        # there is retention lag (one rank already retired its share, another not yet), not a fault.
        fallback = not sets
        if fset.count is None:
            if fallback:
                warn(f"lowdiff: no share of the full checkpoint of step {fset.step} in {root} verifies; "
                     f"falling back to an older set")
            continue
        if not fset.complete:
            missing = [i for i in range(fset.count) if i not in fset.ranks]
            if fallback:
                warn(f"lowdiff: the full checkpoint of step {fset.step} is incomplete in {root}: shares {missing} "
                     f"of {fset.count} are not committed (a rank died while writing?); falling back to an older "
                     f"set")
            continue
        entries = [next(f for f in manifests[i].fulls if (f.step, f.session) == (fset.step, fset.session))
                   for i in range(fset.count)]
        links = [session_chain(manifests[i], fset.step, fset.session) for i in range(fset.count)]
        chains = tuple(tuple(b.file for b in chain) for chain in links)
        dirs = tuple(tuple(getattr(b, "dir", None) for b in chain) for chain in links)
        files = tuple(os.path.join(rank_directory(root, i), e.file) for i, e in enumerate(entries))
        sets.append(FullSet(fset.step, fset.session, fset.count, files, chains, fset.reach(manifests),
                            dirs if any(d is not None for chain in dirs for d in chain) else ()))
    # Newest step first; among sets of one step (a run resumed at a full set's step writes its base
    # set there too, in a new session), the one whose chain reaches furthest — not the session
    # names' order, which is random: the abandoned timeline's set, its chain dropped, reaches only
    # its own step.
    sets.sort(key=lambda s: (s.step, s.reach), reverse=True)
    ranges = retained_ranges(manifests, every)
    return Survey(sets, newest, ranges, describe_ranges(ranges, every),
                  missing_rank_directories(root, manifests, every))


def plan_sets(root: str, stop_step: int | None, files: LocalFiles = LOCAL) -> tuple[list, int]:
    """(complete full sets at or before ``stop_step``, newest first; the newest step any rank
    directory lists)."""
    found = plan(root, stop_step, files.views(), files.count_of)
    return found.sets, found.newest


def broadcast_plan(root: str, stop_step: int | None, world: int, files: LocalFiles = LOCAL) -> Survey:
    """Rank 0's survey, on every rank. What it raised surveying is raised on every rank (a rank
    directory's drive not mounted: MissingDeviceError by name), so no rank waits for a plan."""
    if world == 1:
        return plan(root, stop_step, files.views(), files.count_of)
    error: CheckpointError | None = None
    found: list = [None]
    if dist.get_rank() == 0:
        try:
            found = [plan(root, stop_step, files.views(), files.count_of)]
        except CheckpointError as exc:
            error, found = exc, [(isinstance(exc, MissingDeviceError), str(exc))]
    dist.broadcast_object_list(found, src=0)
    if error is not None:
        raise error
    if isinstance(found[0], tuple):
        missing_drive, message = found[0]
        raise (MissingDeviceError if missing_drive else CheckpointError)(message)
    return found[0]
