"""lowdiff.distributed.partition: how the ranks of a data-parallel run split their checkpoints
(docs/format.md, "Partitioned directories"), which sets of shares are complete, the steps their
chains reach (the durable step, the retained steps) and each rank directory's view (committed, for
a live trainer's retention; reconciled with the files, for readers).

A ``Partition`` is one rank's part in it: the directory it writes (``rank-NNNNN/`` of the root),
which tensors of a full checkpoint are shared (parameters and optimizer state, the same on every
rank) and which parameters' gradients its differential shares hold. Nothing here runs a collective
per step: the only one is at ``join`` (wrap time), where rank 0's session and run are sent to all.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import fastio
from lowdiff.distributed.dtensors import assign_holders, chunk_entry, is_dtensor, local_chunk, replica_group
from lowdiff.distributed.sharesnapshot import ShareSnapshot
from lowdiff.errors import CheckpointError, MissingDeviceError, MissingRankDirectoryError
from lowdiff.format.records import StepRecord, encode_record
from lowdiff.format.sharefile import read_full_share_index, write_diff_share
from lowdiff.step.compress import Compressed
from lowdiff.store.inventory import Inventory, take_inventory
from lowdiff.store.manifest import FullEntry, Manifest, plan_chain, read_manifest
from lowdiff.store.rankdirs import is_partitioned, rank_directories, rank_directory
from lowdiff.store.stripes import check_devices

_NONE = Compressed("none", 0, None)   # a gradient another share records (encoded as "none")


def assign_slots(numels: list[int], count: int) -> list[list[int]]:
    """Parameter positions owned by each of ``count`` shares: largest first to the share with the
    fewest elements so far (ties: the lowest share index). Each list is sorted."""
    loads = [0] * count
    owned: list[list[int]] = [[] for _ in range(count)]
    for slot in sorted(range(len(numels)), key=lambda s: (-numels[s], s)):
        share = min(range(count), key=lambda i: (loads[i], i))
        owned[share].append(slot)
        loads[share] += numels[slot]
    return [sorted(slots) for slots in owned]


@dataclasses.dataclass(frozen=True)
class ShareSet:
    """One full checkpoint of a partitioned directory as its rank directories list it."""

    step: int
    session: str
    count: int | None         # shares in the set, from a share's index (None: no share is readable)
    ranks: frozenset          # the rank directories that list a share of it

    @property
    def complete(self) -> bool:
        """Every share is listed (committed) in its rank's directory."""
        return self.count is not None and all(i in self.ranks for i in range(self.count))

    def reach(self, manifests: dict) -> int:
        """The newest step every share's chain of differentials (batches of the set's session
        continuing its step) reaches, by the manifests; the set's own step if a share has none."""
        ends = []
        for i in range(self.count or 0):
            chain = session_chain(manifests.get(i) or Manifest(), self.step, self.session)
            ends.append(chain[-1].last if chain else self.step)
        return min(ends, default=self.step)


def session_chain(manifest: Manifest, base_step: int, session: str) -> list:
    """The batches of ``session`` continuing ``base_step`` contiguously (a set's chain in one share)."""
    return plan_chain(Manifest(batches=[b for b in manifest.batches if b.session == session]), base_step)


def share_count(root, rank: int, entry: FullEntry) -> int | None:
    """The number of shares of ``entry``'s set, read from the index of ``rank``'s share (None: it
    does not verify)."""
    path = os.path.join(rank_directory(root, rank), entry.file)
    try:
        with fastio.Reader(path) as reader:
            return read_full_share_index(path, reader).count
    except (CheckpointError, OSError, EOFError):
        return None


def full_sets(root, manifests: Mapping[int, Manifest | None], count_of=None) -> list[ShareSet]:
    """Every full checkpoint any rank directory lists, as a ShareSet, oldest first. A set's share
    count is ``count_of(step, session)`` when that gives one, else read from the first listed
    share whose index verifies."""
    listed: dict = {}
    for rank, manifest in manifests.items():
        for full in (manifest.fulls if manifest is not None else ()):
            listed.setdefault((full.step, full.session), {})[rank] = full
    out = []
    for (step, session), shares in sorted(listed.items()):
        count = count_of(step, session) if count_of is not None else None
        for rank in sorted(shares):
            if count is not None:
                break
            count = share_count(root, rank, shares[rank])
        out.append(ShareSet(step, session, count, frozenset(shares)))
    return out


def missing_rank_directories(root, manifests: Mapping[int, Manifest | None], sets: list) -> dict[int, list[int]]:
    """{rank: [steps]}: the rank directories of ``root`` that do not exist although sets need them,
    with the steps of those sets. A set needs rank ``r``'s directory when its share count says it has
    more than ``r`` shares and every rank directory that exists among its shares lists it: it would
    be complete but for directories that are absent (a volume not mounted yet, a copy in progress).
    Such a directory is never empty by accident (each rank of a session creates its own at wrap),
    and reading it as empty would let retention delete the shares the set still needs. A dropped
    rank's directory removed by shareretention is not reported: its holder no longer lists the sets
    that needed it. ``manifests``: one per existing rank directory."""
    present = set(rank_directories(root)) | set(manifests)
    out: dict[int, list[int]] = {}
    for fset in sets:
        if fset.count is None:
            continue
        absent = [i for i in range(fset.count) if i not in present]
        if absent and all(i in fset.ranks for i in range(fset.count) if i in present):
            for rank in absent:
                out.setdefault(rank, []).append(fset.step)
    return out


def missing_directory_error(root, missing: dict[int, list[int]]) -> CheckpointError:
    """The refusal for ``missing_rank_directories``: names each directory and what to do."""
    named = "; ".join(f"{rank_directory(root, rank)} (shares of the full checkpoints of steps "
                      f"{', '.join(str(s) for s in sorted(steps))})" for rank, steps in sorted(missing.items()))
    return MissingRankDirectoryError(
        f"{os.fspath(root)} is a partitioned directory with rank directories missing: {named}. Their "
        f"checkpoints are needed to resume, and nothing is read or deleted without them: mount or copy "
        f"the missing directories back; if they are truly lost, move this directory away and start "
        f"from an older copy or anew")


def check_rank_directories(root, manifests: Mapping[int, Manifest | None] | None = None) -> None:
    """Raise MissingRankDirectoryError when a rank directory that sets need is absent (see
    ``missing_rank_directories``). ``manifests``: each existing rank directory's (default: the
    committed ones)."""
    if manifests is None:
        manifests = read_manifests(root, sorted(rank_directories(root)))
    missing = missing_rank_directories(root, manifests, full_sets(root, manifests))
    if missing:
        raise missing_directory_error(root, missing)
    for rank, manifest in manifests.items():   # a share's stripe or batch on a drive not mounted
        if manifest is not None:
            check_devices(rank_directory(root, rank), manifest)


def durable_step(manifests: dict, sets: list) -> int:
    """The newest step a resume reaches by the manifests: the furthest any complete set's every
    share reaches (-1: no complete set)."""
    return max((s.reach(manifests) for s in sets if s.complete), default=-1)


def retained_ranges(manifests: dict, sets: list) -> list:
    """[(first, last)] steps the complete sets reach, merged (time travel goes to any of them)."""
    merged: list = []
    for first, last in sorted((s.step, s.reach(manifests)) for s in sets if s.complete):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def describe_ranges(ranges: list, sets: list) -> str:
    """The retained steps of a partitioned directory, for error messages."""
    if not ranges:
        return "it retains no step (no complete full-checkpoint set)"
    steps = ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in ranges)
    return f"retained steps: {steps} (complete full-checkpoint sets at steps " \
           f"{', '.join(str(s.step) for s in sets if s.complete)})"


def read_manifests(root, ranks) -> dict[int, Manifest | None]:
    """The committed manifest of each rank directory (None: missing or damaged). What a live
    trainer's retention decides by: a share counts only once its rank committed it."""
    out: dict[int, Manifest | None] = {}
    for rank in ranks:
        try:
            out[rank] = read_manifest(rank_directory(root, rank))
        except (CheckpointError, OSError):
            out[rank] = None
    return out


def read_views(root, ranks=None, **options) -> dict[int, Inventory]:
    """The reconciled view of each rank directory (lowdiff.store.inventory): what readers (resume,
    verify, inspect) use. A rank's missing or damaged manifest is rebuilt from its share files,
    which describe themselves, so the durable shares it listed are still found (the inventory's
    notes say what was rebuilt; a rank directory that does not exist is left out). Raises what
    take_inventory raises for a foreign manifest, a file of another version or a directory that
    never holds still (``options``: take_inventory's)."""
    ranks = sorted(rank_directories(root)) if ranks is None else ranks
    out = {}
    for rank in ranks:
        directory = rank_directory(root, rank)
        try:
            out[rank] = take_inventory(directory, **options)
        except FileNotFoundError:
            if os.path.isdir(directory):
                raise
            # Gone since it was listed: a dropped rank's directory, removed once it held nothing
            # (lowdiff.distributed.shareretention). A rank without a directory lists no share.
    return out


def partition_for(root, rank: int, world: int, params: list) -> Partition | None:
    """The rank's ``Partition`` when ``root`` is written partitioned: under torch.distributed
    with several processes, or a directory that is partitioned already (then at any world size,
    so that one directory never mixes layouts); None for the single-process layout."""
    if world > 1 or is_partitioned(root) or any(is_dtensor(p) for p in params):
        refuse_missing_rank_directories(root, world)
        return Partition.of(root, rank, world, params)
    return None


def refuse_missing_rank_directories(root, world: int) -> None:
    """Raise MissingRankDirectoryError on every rank when ``root`` lacks a rank directory its sets
    need (check_rank_directories); MissingDeviceError when a rank directory's drive is not mounted
    (lowdiff.store.rankdirs). A collective when ``world`` > 1, before any rank creates its
    own directory: a rank whose directory is missing sees it so, and the others learn it here
    instead of reading the directory that rank is about to create as empty."""
    error: CheckpointError | None = None
    why = None
    try:
        check_rank_directories(root)
    except CheckpointError as exc:   # (also a rank directory's drive not mounted, a damaged DRIVE.json)
        error, why = exc, (type(exc).__name__, str(exc))
    if world > 1:
        import torch.distributed as dist

        said: list = [None] * world
        dist.all_gather_object(said, why)
        why = next((w for w in said if w), None)
    if error is not None:
        raise error
    if why:
        raise _same_error(*why)


def _same_error(name: str, message: str) -> CheckpointError:
    """Another rank's error, raised here too: MissingDeviceError and MissingRankDirectoryError by
    name (what the user is told to do differs), anything else as a CheckpointError."""
    for kind in (MissingDeviceError, MissingRankDirectoryError):
        if kind.__name__ == name:
            return kind(message)
    return CheckpointError(message)


@dataclasses.dataclass
class Partition:
    """One rank's part in a partitioned directory (see the module doc)."""

    root: str
    rank: int
    world: int
    owned: list = dataclasses.field(default_factory=list)   # slots of each share, see assign_slots
    chunks: dict = dataclasses.field(default_factory=dict)  # {slot: chunk entry}: DTensor slots, in every share
    elsewhere: dict = dataclasses.field(default_factory=dict)  # {slot: share}: DTensor gradients another rank
                                                               # of the replicate group records (HSDP)
    session: str | None = None                              # the set's session, from join()
    # This rank's stripe directories on its other share drives (lowdiff.distributed.drives; empty:
    # its shares are not striped).
    stripe_dirs: tuple = ()
    _counts: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def directory(self) -> str:
        return rank_directory(self.root, self.rank)

    @property
    def slots(self) -> list:
        return self.owned[self.rank]

    @classmethod
    def of(cls, root, rank: int, world: int, params: list) -> Partition:
        # A DTensor parameter's gradient differs on every rank (each its local chunk): every share
        # holds its own; the others are assigned to one share each (docs/format.md, "Sharded state").
        # Under HSDP the ranks of a replicate group consume the same chunk: one of them records it
        # ("2-D meshes"). ``owned`` of the other shares lists every DTensor slot (only this rank's is used).
        chunks = {slot: chunk_entry(p) for slot, p in enumerate(params) if is_dtensor(p)}
        holders = assign_holders([(slot, replica_group(params[slot]), local_chunk(params[slot]).nbytes)
                                  for slot in chunks])
        elsewhere = {slot: holder for slot, holder in holders.items() if holder != rank}
        owned = assign_slots([0 if slot in chunks else p.numel() for slot, p in enumerate(params)], world)
        owned = [sorted((set(slots) - set(chunks)) | (set(chunks) - set(elsewhere) if share == rank else set(chunks)))
                 for share, slots in enumerate(owned)]
        return cls(os.path.abspath(os.fspath(root)), rank, world, owned, chunks, elsewhere)

    def snapshot(self):
        """The staging snapshot of this rank's full-checkpoint shares."""
        return ShareSnapshot(self.rank, self.world)

    def join(self, store, anchored: bool | None = None) -> None:
        """Collective, once at wrap: every rank takes rank 0's session, and the run of the lowest
        rank whose run is ``anchored`` in files (default: its store lists some), so the shares of a
        set carry one session and one run. (Rank 0 may have committed nothing before a crash while
        other ranks did: a fresh run of rank 0 would disown their files and their shared tier.)"""
        import torch.distributed as dist

        if self.world > 1:
            if anchored is None:
                anchored = bool(store.manifest.files())
            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, (store.session, store.run, anchored))
            store.session = gathered[0][0]
            store.run = next((run for _, run, known in gathered if known), gathered[0][1])
        self.session = store.session

    # ------------------------------------------------------------ retention
    def complete(self, fulls: list[FullEntry]) -> set:
        """(step, session) among this rank's ``fulls`` (the manifest about to be committed) whose
        set is complete: every other share of it is listed in its rank's committed manifest (read
        from the rank directories; no collective). A set of this session has ``world`` shares; an
        earlier session's, as many as its shares' index says."""
        manifests = self._manifests(Manifest(fulls=list(fulls)))
        mine = {(f.step, f.session) for f in fulls}
        return {(s.step, s.session) for s in self._sets(manifests) if s.complete and (s.step, s.session) in mine}

    def durable_step(self, own: Manifest) -> int:
        """The newest step every share is durable at (what a resume reaches now), with ``own`` as
        this rank's manifest and the other ranks' committed ones."""
        manifests = self._manifests(own)
        return durable_step(manifests, self._sets(manifests))

    def _manifests(self, own: Manifest) -> dict:
        others = sorted((set(range(self.world)) | set(rank_directories(self.root))) - {self.rank})
        return {**read_manifests(self.root, others), self.rank: own}

    def _sets(self, manifests: dict) -> list:
        """full_sets of ``manifests``: a set of this session has ``world`` shares; an earlier
        session's count is read from a share once and remembered (files do not change)."""
        sets = full_sets(self.root, manifests,
                         lambda step, session: self.world if session == self.session else
                         self._counts.get((step, session)))
        self._counts.update({(s.step, s.session): s.count for s in sets if s.count is not None})
        return sets

    # ------------------------------------------------------------ differential shares
    def encode(self, record: StepRecord) -> list:
        """The record's bytes with only this share's gradients (others "none")."""
        mine = set(self.slots)
        grads = [g if slot in mine else _NONE for slot, g in enumerate(record.grads)]
        return encode_record(dataclasses.replace(record, grads=grads))

    def write_batch(self, path: str, session: str, records: list, *, run=None, engine=None) -> int:
        return write_diff_share(path, session, records, run=run, share=(self.rank, self.world), slots=self.slots,
                                engine=engine, dtensors=self.chunks, elsewhere=self.elsewhere)
