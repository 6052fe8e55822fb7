"""lowdiff.partition: how the ranks of a data-parallel run split their checkpoints
(docs/format.md, "Partitioned directories"), and which sets of shares are complete.

A ``Partition`` is one rank's part in it: the directory it writes (``rank-NNNNN/`` of the root),
which tensors of a full checkpoint are shared (parameters and optimizer state, the same on every
rank) and which parameters' gradients its differential shares hold. Nothing here runs a collective
per step: the only one is at ``join`` (wrap time), where rank 0's session and run are sent to all.
"""
from __future__ import annotations

import dataclasses
import os
import re

import fastio

from .compress import Compressed
from .errors import CheckpointError
from .manifest import FullEntry, Manifest, read_manifest
from .records import StepRecord, encode_record
from .sharefile import read_full_share_index, write_diff_share

RANK_DIR_RE = re.compile(r"^rank-(\d{5})$")
_NONE = Compressed("none", 0, None)   # a gradient another share records (encoded as "none")


def rank_directory(root, rank: int) -> str:
    """Where rank ``rank`` of a partitioned directory keeps its shares."""
    return os.path.join(os.fspath(root), f"rank-{rank:05d}")


def rank_directories(root) -> dict[int, str]:
    """{rank: path} of the ``rank-NNNNN/`` subdirectories of ``root``."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out = {}
    for name in names:
        m = RANK_DIR_RE.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out[int(m.group(1))] = os.path.join(root, name)
    return out


def is_partitioned(root) -> bool:
    """Whether ``root`` is a partitioned directory (it has rank subdirectories)."""
    return bool(rank_directories(root))


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


def is_shared_key(key: str, param_aliases: dict) -> bool:
    """Whether a full checkpoint's tensor ``key`` is the same on every rank: a parameter or
    optimizer state. Buffers, RNG, residuals and extra_state are each rank's own."""
    if key.startswith("/optimizer/state/"):
        return True
    return key.startswith("/model/") and key[len("/model/"):] in param_aliases


def complete_fulls(root, manifests: dict[int, Manifest | None], count_of) -> set:
    """(step, session) of the full checkpoints whose every share is listed in its rank's manifest.
    ``count_of(entry)`` gives the number of shares of ``entry``'s set (None: unknown)."""
    complete = set()
    listed = {rank: {(f.step, f.session) for f in m.fulls} for rank, m in manifests.items() if m is not None}
    for rank, names in listed.items():
        for step, session in names:
            count = count_of(rank, step, session)
            if count and all((step, session) in listed.get(i, ()) for i in range(count)):
                complete.add((step, session))
    return complete


def read_manifests(root, ranks) -> dict[int, Manifest | None]:
    """The committed manifest of each rank directory (None: missing or damaged)."""
    out: dict[int, Manifest | None] = {}
    for rank in ranks:
        try:
            out[rank] = read_manifest(rank_directory(root, rank))
        except (CheckpointError, OSError):
            out[rank] = None
    return out


def partition_for(root, rank: int, world: int, params: list) -> Partition | None:
    """The rank's ``Partition`` when ``root`` is written partitioned: under torch.distributed
    with several processes, or a directory that is partitioned already (then at any world size,
    so that one directory never mixes layouts); None for the single-process layout."""
    if world > 1 or is_partitioned(root):
        return Partition.of(root, rank, world, params)
    return None


@dataclasses.dataclass
class Partition:
    """One rank's part in a partitioned directory (see the module doc)."""

    root: str
    rank: int
    world: int
    owned: list = dataclasses.field(default_factory=list)   # slots of each share, see assign_slots
    session: str | None = None                              # the set's session, from join()

    @property
    def directory(self) -> str:
        return rank_directory(self.root, self.rank)

    @property
    def slots(self) -> list:
        return self.owned[self.rank]

    @classmethod
    def of(cls, root, rank: int, world: int, params: list) -> Partition:
        return cls(os.path.abspath(os.fspath(root)), rank, world, assign_slots([p.numel() for p in params], world))

    def snapshot(self):
        """The staging snapshot of this rank's full-checkpoint shares."""
        from .sharesnapshot import ShareSnapshot  # (it uses is_shared_key from here)
        return ShareSnapshot(self.rank, self.world)

    def join(self, store) -> None:
        """Collective, once at wrap: every rank takes rank 0's session and run, so the shares of a
        set carry one session and one run."""
        import torch.distributed as dist

        if self.world > 1:
            agreed = [(store.session, store.run)]
            dist.broadcast_object_list(agreed, src=0)
            store.session, store.run = agreed[0]
        self.session = store.session

    # ------------------------------------------------------------ retention
    def complete(self, fulls: list[FullEntry]) -> set:
        """(step, session) among this rank's ``fulls`` whose set is complete: every share of it is
        listed in its rank's committed manifest (read from the rank directories; no collective).
        A set of this session has ``world`` shares; an earlier session's, as many as its file says."""
        ranks = sorted(set(range(self.world)) | set(rank_directories(self.root)))
        manifests = read_manifests(self.root, ranks)
        counts = {(f.step, f.session): self.world if f.session == self.session else self._count_in_file(f)
                  for f in fulls}
        return complete_fulls(self.root, manifests, lambda rank, step, session: counts.get((step, session))
                              if rank == self.rank else None)

    def _count_in_file(self, entry: FullEntry) -> int | None:
        path = os.path.join(self.directory, entry.file)
        try:
            with fastio.Reader(path) as reader:
                return read_full_share_index(path, reader).count
        except (CheckpointError, OSError, EOFError):
            return None

    # ------------------------------------------------------------ differential shares
    def encode(self, record: StepRecord) -> list:
        """The record's bytes with only this share's gradients (others "none")."""
        mine = set(self.slots)
        grads = [g if slot in mine else _NONE for slot, g in enumerate(record.grads)]
        return encode_record(dataclasses.replace(record, grads=grads))

    def write_batch(self, path: str, session: str, records: list, *, run=None, engine=None) -> int:
        return write_diff_share(path, session, records, run=run, share=(self.rank, self.world), slots=self.slots,
                                engine=engine)
