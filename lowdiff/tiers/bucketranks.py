"""The partitioned layout in a bucket (docs/format.md, "Shared tier in an object store",
partitioned runs): a ``rank-NNNNN`` prefix per rank, each a prefix of lowdiff.tiers.bucket's layout
of its own; which sets are complete and the step a resume from the bucket reaches, by every rank's
newest commit; the prefixes of ranks a smaller run dropped; staging every prefix for the CLI.
"""
from __future__ import annotations

import dataclasses
import os

from lowdiff.distributed.partition import durable_step, full_sets
from lowdiff.errors import CheckpointError
from lowdiff.format.sharefile import read_full_share_index
from lowdiff.store.manifest import Manifest
from lowdiff.store.rankdirs import RANK_DIR_RE, rank_directory
from lowdiff.tiers.bucket import MANIFEST_RE, read_bucket, stage
from lowdiff.tiers.objectstore import ObjectStore, S3Client, parse_s3_url

__all__ = ["bucket_layout", "check_bucket_layout", "complete_in_bucket", "dropped_prefixes", "durable_in_bucket",
           "rank_url", "stage_partitioned"]


def rank_url(url: str, rank: int) -> str:
    """Where rank ``rank`` of a partitioned run keeps its shares: ``url/rank-NNNNN`` (a rank
    directory's name, docs/format.md)."""
    return f"{url.rstrip('/')}/{os.path.basename(rank_directory('', rank))}"


def bucket_layout(url: str, options: ObjectStore | None = None) -> str | None:
    """"single": commits directly under ``url``; "partitioned": ``rank-NNNNN`` prefixes under it;
    None: neither."""
    client = S3Client(parse_s3_url(url), options or ObjectStore())
    if any(MANIFEST_RE.match(name) for name in client.listing()):
        return "single"
    return "partitioned" if any(RANK_DIR_RE.match(name) for name in client.children("rank-")) else None


def check_bucket_layout(url: str, partitioned: bool, options: ObjectStore | None) -> None:
    """One prefix never mixes the single-process and the partitioned layout (as a directory)."""
    found = bucket_layout(url, options)
    if partitioned and found == "single":
        raise CheckpointError(f"{url} holds single-process checkpoints: a partitioned run (torch.distributed) "
                              f"cannot drain into it; name another shared tier")
    if not partitioned and found == "partitioned":
        raise CheckpointError(f"{url} is partitioned (written under torch.distributed): a single-process run "
                              f"cannot drain into it; name another shared tier")


def complete_in_bucket(partition, url: str, options: ObjectStore | None):
    """``complete(fulls)`` of this rank's prefix: the (step, session) of ``fulls`` whose set every
    other rank's newest commit lists (read at each call). Only sets of this session (``world``
    shares) are counted; an earlier session's share count is in its files and is not read, so its
    sets count as incomplete: retention keeps them while no newer set is complete (storage, never
    data)."""
    clients: dict = {}

    def complete(fulls) -> set:
        mine = {(f.step, f.session) for f in fulls if f.session == partition.session}
        for rank in range(partition.world):
            if not mine:
                break
            if rank != partition.rank:
                if rank not in clients:
                    clients[rank] = S3Client(parse_s3_url(rank_url(url, rank)), options or ObjectStore())
                committed = read_bucket(clients[rank])
                mine &= {(f.step, f.session) for f in committed.manifest.fulls} if committed else set()
        return mine
    return complete


def dropped_prefixes(url: str, partition, options: ObjectStore | None) -> list:
    """The URLs of the ``rank-R`` prefixes of ``url`` that ``partition`` (this rank of a run of
    ``partition.world`` ranks) removes once its session has a complete set: those of ranks R >=
    the world size with R mod world = this rank (docs/format.md, "Shared tier in an object store")."""
    client = S3Client(parse_s3_url(url), options or ObjectStore())
    ranks = sorted(int(m.group(1)) for name in client.children("rank-") if (m := RANK_DIR_RE.match(name)))
    return [rank_url(url, r) for r in ranks if r >= partition.world and r % partition.world == partition.rank]


def durable_in_bucket(partition, url: str, options: ObjectStore | None):
    """``durable(own)`` of this rank's prefix: the step a resume from the bucket alone reaches now,
    the furthest any complete set's every share reaches (lowdiff.distributed.partition.durable_step)
    by the newest commits of every ``rank-NNNNN`` prefix (``own``: this rank's manifest), read at
    each call. A set of this session has ``partition.world`` shares; another session's count is
    read once from a share's index by ranged GETs (a set whose count cannot be read is left out)."""
    options = options or ObjectStore()
    root = S3Client(parse_s3_url(url), options)
    clients: dict = {}
    counts: dict = {}

    def client(rank: int) -> S3Client:
        if rank not in clients:
            clients[rank] = S3Client(parse_s3_url(rank_url(url, rank)), options)
        return clients[rank]

    def count(rank: int, entry) -> None:
        """Read the share count of ``entry``'s set (an object the size its entry says: a copy)."""
        if (entry.step, entry.session) not in counts:
            try:
                counts[(entry.step, entry.session)] = read_full_share_index(
                    f"{client(rank).url}/{entry.file}", _Ranges(client(rank), entry.file, entry.nbytes)).count
            except (CheckpointError, OSError, EOFError):
                pass   # (left out, read again at the next call)

    def durable(own: Manifest) -> int:
        manifests: dict = {partition.rank: own}
        for name in root.children("rank-"):
            m = RANK_DIR_RE.match(name)
            if m is not None and int(m.group(1)) != partition.rank:
                committed = read_bucket(client(int(m.group(1))))
                if committed is not None:
                    manifests[int(m.group(1))] = committed.manifest
        for rank, manifest in manifests.items():
            for entry in manifest.fulls:
                if entry.session != partition.session:
                    count(rank, entry)
        known = {**counts, **{(f.step, f.session): partition.world for m in manifests.values() for f in m.fulls
                              if f.session == partition.session}}
        manifests = {rank: dataclasses.replace(m, fulls=[f for f in m.fulls if (f.step, f.session) in known])
                     for rank, m in manifests.items()}
        return durable_step(manifests, full_sets(None, manifests, lambda step, session: known[(step, session)]))
    return durable


class _Ranges:
    """Parts of an object read by ranged GETs, as a file's reader (``read(offset, n)``, ``size``)."""

    def __init__(self, client: S3Client, name: str, size: int):
        self.client, self.name, self.size = client, name, size

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.client.get_range(self.name, offset, nbytes)


def stage_partitioned(url: str, directory: str, options: ObjectStore | None = None) -> list:
    """``stage`` of every rank prefix of ``url`` into ``directory/rank-NNNNN`` (a partitioned
    directory). Returns [(object URL, why)] of the objects left out."""
    client = S3Client(parse_s3_url(url), options or ObjectStore())
    problems: list = []
    for name in sorted(n for n in client.children("rank-") if RANK_DIR_RE.match(n)):
        target = os.path.join(directory, name)
        os.makedirs(target)
        problems += [(f"{url}/{name}/{file}", why) for file, why in
                     stage(f"{url.rstrip('/')}/{name}", target, options=options)[1]]
    return problems
