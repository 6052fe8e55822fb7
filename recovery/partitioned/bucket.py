"""recovery.partitioned.bucket: the files of a partitioned run's bucket (docs/format.md, "Shared
tier in an object store": a ``rank-NNNNN`` prefix per rank) as a restore reaches them, without
downloading the bucket first.

Rank 0 reads every prefix's newest commit (its manifest object only) and sends them to every rank
(``read_commits``); the survey of the sets (recovery.partitioned.plan) is made from those, each set's
share count read from a share's index by ranged GETs. A rank then fetches only what it reads itself
(recovery.partitioned.load.reads_of): the full shares i = rank mod W of the set it loads, its own
first; the indexes of those shares' differential files (ranged GETs: the chain is planned by
them); the differential files whole as the replay reaches them, a few ahead (lowdiff.tiers.fetch);
and, when DTensor state is resharded, the other shares' full files (their chunks). What the ranks
need of each other's shares (indexes, bytes) they exchange as they do for a directory. Every object
read whole is checked against the size and CRC-32C its commit names before it is used; an index
read by ranges, by its own checksum.
"""
from __future__ import annotations

import os

from lowdiff.errors import CheckpointError
from lowdiff.format.sharefile import read_full_share_index
from lowdiff.store.inventory import Inventory
from lowdiff.store.rankdirs import RANK_DIR_RE, rank_directory
from lowdiff.tiers.bucket import read_bucket
from lowdiff.tiers.bucketranks import rank_url
from lowdiff.tiers.fetch import BucketFetch, ObjectRanges
from lowdiff.tiers.objectstore import ObjectStore, S3Client, parse_s3_url
from recovery.partitioned.plan import FullSet, LocalFiles
from recovery.pipeline.bucket import unreachable

__all__ = ["BucketShares", "read_commits"]


def read_commits(url: str, options: ObjectStore | None) -> dict:
    """{rank: BucketManifest} of every ``rank-NNNNN`` prefix of ``url`` that has a commit (raises
    what reading them raises)."""
    client = S3Client(parse_s3_url(url), options or ObjectStore())
    commits = {}
    for name in sorted(n for n in client.children("rank-") if RANK_DIR_RE.match(n)):
        rank = int(RANK_DIR_RE.match(name).group(1))   # type: ignore[union-attr]
        committed = read_bucket(S3Client(parse_s3_url(rank_url(url, rank)), options or ObjectStore()))
        if committed is not None:
            commits[rank] = committed
    return commits


class BucketShares(LocalFiles):
    """The rank prefixes' ``commits`` (read_commits, the same on every rank) as files under
    ``root`` (this rank's temporary directory), fetched as the restore asks for them
    (recovery.partitioned.plan.LocalFiles). ``failure``: the first error that said the store
    cannot be reached (the restore goes on as if the object were damaged, so that the ranks stay
    in step; the caller fails the resume with it afterwards). Close it when done."""

    remote = True

    def __init__(self, url: str, root: str, commits: dict, options: ObjectStore | None):
        self.url, self.root, self.commits = url, root, commits
        self.options = options or ObjectStore()
        self.failure: BaseException | None = None
        self._clients: dict = {}
        self._fetches: dict = {}
        self._counts: dict = {}
        for rank in commits:
            os.makedirs(rank_directory(root, rank), exist_ok=True)

    def client(self, rank: int) -> S3Client:
        if rank not in self._clients:
            self._clients[rank] = S3Client(parse_s3_url(rank_url(self.url, rank)), self.options)
        return self._clients[rank]

    def fetch(self, rank: int) -> BucketFetch:
        if rank not in self._fetches:
            self._fetches[rank] = BucketFetch(self.client(rank), self.commits[rank], rank_directory(self.root, rank),
                                              threads=self.options.max_concurrency)
        return self._fetches[rank]

    # ------------------------------------------------------------ planning (rank 0)
    def views(self) -> dict:
        return {rank: Inventory(committed.manifest, None) for rank, committed in self.commits.items()}

    def count_of(self, step: int, session: str) -> int | None:
        """The share count of the set (step, session), from the index of the first share that
        lists it and whose index verifies (read by ranges; None: none does)."""
        key = (step, session)
        if key not in self._counts:
            self._counts[key] = None
            for rank, committed in sorted(self.commits.items()):
                entry = next((f for f in committed.manifest.fulls if (f.step, f.session) == key), None)
                if entry is None:
                    continue
                try:
                    with self.index_reader(os.path.join(rank_directory(self.root, rank), entry.file)) as reader:
                        self._counts[key] = read_full_share_index(entry.file, reader).count
                    break
                except (CheckpointError, OSError, EOFError):
                    continue
        return self._counts[key]

    # ------------------------------------------------------------ reading (every rank)
    def expect(self, fset: FullSet, shares: list) -> None:
        for share in shares:
            if share in self.commits:
                self.fetch(share).expect([os.path.basename(fset.files[share])] + list(fset.chains[share]))

    def ready(self, path: str) -> str:
        rank, name = self._locate(path)
        try:
            return self.fetch(rank).wait(name)
        except BaseException as exc:
            self._note(exc)
            raise

    def index_reader(self, path: str):
        rank, name = self._locate(path)
        arrived = self.fetch(rank).arrived(name) if rank in self._fetches else None
        if arrived is not None:
            return super().index_reader(arrived)
        return _Noted(self, ObjectRanges(self.client(rank), self.commits[rank], name))

    def _locate(self, path: str) -> tuple:
        """(rank, object name) of a path under any rank's root (plans name rank 0's)."""
        directory, name = os.path.split(path)
        m = RANK_DIR_RE.match(os.path.basename(directory))
        if m is None or int(m.group(1)) not in self.commits:
            raise FileNotFoundError(f"{path} is in no rank prefix of {self.url} with a commit")
        if self.failure is not None:   # the store cannot be reached: no new request waits for it again
            raise self.failure
        return int(m.group(1)), name

    def _note(self, exc: BaseException) -> None:
        if self.failure is None and unreachable(exc):
            self.failure = exc

    def close(self) -> None:
        for fetch in self._fetches.values():
            fetch.close()
        self._fetches = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _Noted:
    """An ObjectRanges whose store errors are noted by its BucketShares (see ``failure``)."""

    def __init__(self, shares: BucketShares, ranges: ObjectRanges):
        self._shares, self._ranges = shares, ranges
        self.size = ranges.size

    def read(self, offset: int, nbytes: int) -> bytes:
        try:
            return self._ranges.read(offset, nbytes)
        except BaseException as exc:
            self._shares._note(exc)
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._ranges.close()
        return False
