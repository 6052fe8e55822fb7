"""Storage tiers: their configuration (``Tiers``) and the store of a tier (``PolicyStore``: a
CheckpointStore whose retention is a policy). The ``TIERS.json`` marker and the checks that keep
both tiers one run are lowdiff.tiers.marker (docs/format.md, "Storage tiers").

Training writes the local (fast) directory; lowdiff.tiers.drainer copies each committed file to the
shared directory in the background and commits it there with the same protocol. Each tier keeps
what its own policy (lowdiff.store.retention) says, and the local tier never lets go of a file the
drainer has not copied yet.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

from lowdiff.distributed.partition import Partition, is_partitioned, partition_for
from lowdiff.store.directory import CheckpointStore
from lowdiff.store.manifest import BatchEntry, Manifest
from lowdiff.store.retention import KeepAll, KeepEvery, KeepLast, Policy, check_policy
from lowdiff.tiers.objectstore import ObjectStore, is_object_url, parse_s3_url

__all__ = ["KeepAll", "KeepEvery", "KeepLast", "Tiers"]

@dataclasses.dataclass(frozen=True)
class Tiers:
    """Where and how checkpoints are staged. ``shared_dir``: the shared (slow, durable across
    node loss) directory; ``local``/``shared``: each tier's retention policy (``local`` None: the
    ``retention`` of ``wrap``, ``KeepLast(2)`` by default); ``max_lag_steps``: how many committed steps the shared
    tier may be behind the local one before ``step()`` waits for the drainer (backpressure);
    ``verify_copies``: read each copy back from the shared tier and compare its CRC-32C before it
    is renamed into place (as many bytes read from the shared file system as written; False skips
    it where that traffic costs more than the check is worth). ``shared_dir`` may be an
    ``s3://bucket/prefix`` URL (lowdiff.tiers.bucket); ``object_store``: how it is written
    (lowdiff.tiers.objectstore.ObjectStore; None: its defaults)."""

    shared_dir: str
    local: Policy | None = None
    shared: Policy = KeepLast(2)
    max_lag_steps: int = 500
    verify_copies: bool = True
    object_store: ObjectStore | None = None

    def __post_init__(self):
        if not isinstance(self.shared_dir, (str, os.PathLike)):
            raise TypeError(f"shared_dir must be a path, got {type(self.shared_dir).__name__}")
        if is_object_url(self.shared_dir):
            object.__setattr__(self, "shared_dir", str(parse_s3_url(self.shared_dir)))
        elif "://" in os.fspath(self.shared_dir):
            # A URL made into a path would drain into a local directory named like "s3:".
            raise ValueError(f"shared_dir={self.shared_dir!r}: only s3:// URLs are supported (or a directory path)")
        else:
            object.__setattr__(self, "shared_dir", os.path.abspath(os.fspath(self.shared_dir)))
        if self.object_store is not None and not isinstance(self.object_store, ObjectStore):
            raise TypeError(f"object_store must be lowdiff.tiers.ObjectStore(...), "
                            f"got {type(self.object_store).__name__}")
        if self.local is not None:
            check_policy("Tiers(local=...)", self.local)
        check_policy("Tiers(shared=...)", self.shared)
        if isinstance(self.max_lag_steps, bool) or not isinstance(self.max_lag_steps, int) or self.max_lag_steps < 1:
            raise ValueError(f"max_lag_steps={self.max_lag_steps!r} must be an int >= 1")
        if not isinstance(self.verify_copies, bool):
            raise TypeError(f"verify_copies={self.verify_copies!r} must be True or False")

    def local_policy(self, default: Policy) -> Policy:
        """The local tier's policy: ``local``, or ``default`` (wrap's ``retention``) when None."""
        return self.local if self.local is not None else default


def tiers_partition(directory, tiers: Tiers | None, rank: int, world: int, params: list) -> Partition | None:
    """The rank's Partition (lowdiff.distributed.partition.partition_for), also when only the shared tier is
    partitioned: nodes replaced with empty local directories continue a partitioned run."""
    partition = partition_for(directory, rank, world, params)
    if partition is None and tiers is not None and not is_object_url(tiers.shared_dir) and \
            is_partitioned(tiers.shared_dir):
        partition = Partition.of(directory, rank, world, params)
    return partition


class PolicyStore(CheckpointStore):
    """A tier's store: retention by ``policy`` (lowdiff.store.retention.retain, as every store),
    never dropping a file ``pinned()`` names; after each commit, ``on_commit(manifest)`` (called
    with the store's mutex held: keep it short). ``complete`` (a partitioned tier, see
    CheckpointStore): the policy counts complete sets only."""

    def __init__(self, directory: str, policy: Policy, *, pinned: Callable[[], set] | None = None,
                 clean_point: str = "retention", complete=None, stripe_dirs=()):
        self.on_commit: Callable[[Manifest], None] | None = None
        self.clean_point = clean_point
        super().__init__(directory, policy, complete=complete, pinned=pinned, stripe_dirs=stripe_dirs)

    def _commit(self, manifest: Manifest) -> None:
        super()._commit(manifest)
        if self.on_commit is not None:
            self.on_commit(self.manifest)

    def clean(self) -> None:
        """Apply retention now (files the drainer has copied meanwhile may go)."""
        with self._mutex:
            kept = self._retain(self.manifest)
            if kept.files() != self.manifest.files():
                self._commit(kept)

    def listed(self) -> Manifest:
        """The committed manifest (a consistent snapshot)."""
        with self._mutex:
            return self.manifest

    def commit_copied(self, entry) -> None:
        """List ``entry``, a file just committed here under its own name (copied from another tier),
        then apply retention (see ``_with``)."""
        with self._mutex:
            self._commit(self._retain(_with(self.manifest, entry)))

    def would_keep(self, entry) -> bool:
        """Whether retention would keep ``entry`` if it were listed now (an old file the policy
        drops at once is not worth copying)."""
        with self._mutex:
            return entry.file in self._retain(_with(self.manifest, entry)).files()


def _with(manifest: Manifest, entry) -> Manifest:
    """``manifest`` listing ``entry`` too. The first full checkpoint of a session is its base:
    entries of other sessions after its step belong to a timeline abandoned when that session
    resumed; they are dropped (as the local store does when it commits the base)."""
    if isinstance(entry, BatchEntry):
        return dataclasses.replace(manifest, batches=manifest.batches + [entry])
    if not any(f.session == entry.session for f in manifest.fulls):
        manifest = dataclasses.replace(
            manifest, fulls=[f for f in manifest.fulls if f.session == entry.session or f.step <= entry.step],
            batches=[b for b in manifest.batches if b.session == entry.session or b.last <= entry.step])
    return dataclasses.replace(manifest, fulls=manifest.fulls + [entry])
