"""Storage tiers: their configuration (``Tiers``), the store of a tier (``PolicyStore``: a
CheckpointStore whose retention is a policy) and the ``TIERS.json`` marker that tells readers a
directory has a shared tier (docs/format.md, "Storage tiers").

Training writes the local (fast) directory; lowdiff.drainer copies each committed file to the
shared directory in the background and commits it there with the same protocol. Each tier keeps
what its own policy (lowdiff.retention) says, and the local tier never lets go of a file the
drainer has not copied yet.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import fastio

from .errors import CheckpointError, CorruptCheckpointError
from .inventory import is_dead_temp
from .manifest import MANIFEST_NAME, BatchEntry, Manifest
from .partition import Partition, is_partitioned, partition_for
from .retention import KeepAll, KeepEvery, KeepLast, Policy, check_policy, retain_sets
from .store import CheckpointStore

__all__ = ["KeepAll", "KeepEvery", "KeepLast", "Tiers"]

TIERS_NAME = "TIERS.json"
TIERS_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Tiers:
    """Where and how checkpoints are staged. ``shared_dir``: the shared (slow, durable across
    node loss) directory; ``local``/``shared``: each tier's retention policy (``local`` None:
    ``KeepLast(keep_full)`` of ``wrap``); ``max_lag_steps``: how many committed steps the shared
    tier may be behind the local one before ``step()`` waits for the drainer (backpressure);
    ``verify_copies``: read each copy back from the shared tier and compare its CRC-32C before it
    is renamed into place (as many bytes read from the shared file system as written; False skips
    it where that traffic costs more than the check is worth)."""

    shared_dir: str
    local: Policy | None = None
    shared: Policy = KeepLast(2)
    max_lag_steps: int = 500
    verify_copies: bool = True

    def __post_init__(self):
        if not isinstance(self.shared_dir, (str, os.PathLike)):
            raise TypeError(f"shared_dir must be a path, got {type(self.shared_dir).__name__}")
        object.__setattr__(self, "shared_dir", os.path.abspath(os.fspath(self.shared_dir)))
        if self.local is not None:
            check_policy("Tiers(local=...)", self.local)
        check_policy("Tiers(shared=...)", self.shared)
        if isinstance(self.max_lag_steps, bool) or not isinstance(self.max_lag_steps, int) or self.max_lag_steps < 1:
            raise ValueError(f"max_lag_steps={self.max_lag_steps!r} must be an int >= 1")
        if not isinstance(self.verify_copies, bool):
            raise TypeError(f"verify_copies={self.verify_copies!r} must be True or False")

    def local_policy(self, keep_full: int) -> Policy:
        return self.local if self.local is not None else KeepLast(keep_full)


def tiers_from(shared_dir, tiers) -> Tiers | None:
    """The tiers of ``wrap(shared_dir=..., tiers=...)`` (one of them, or neither)."""
    if tiers is not None:
        if not isinstance(tiers, Tiers):
            raise TypeError(f"tiers must be lowdiff.tiers.Tiers(...), got {type(tiers).__name__}")
        if shared_dir is not None and os.path.abspath(os.fspath(shared_dir)) != tiers.shared_dir:
            raise ValueError(f"shared_dir={shared_dir!r} differs from tiers.shared_dir={tiers.shared_dir!r}")
        return tiers
    return None if shared_dir is None else Tiers(shared_dir)


def tiers_partition(directory, tiers: Tiers | None, rank: int, world: int, params: list) -> Partition | None:
    """The rank's Partition (lowdiff.partition.partition_for), also when only the shared tier is
    partitioned: nodes replaced with empty local directories continue a partitioned run."""
    partition = partition_for(directory, rank, world, params)
    if partition is None and tiers is not None and is_partitioned(tiers.shared_dir):
        partition = Partition.of(directory, rank, world, params)
    return partition


class PolicyStore(CheckpointStore):
    """A tier's store: retention by ``policy``, never dropping a file ``pinned()`` names; after
    each commit, ``on_commit(manifest)`` (called with the store's mutex held: keep it short).
    ``complete`` (a partitioned tier, see CheckpointStore): the policy counts complete sets only."""

    def __init__(self, directory: str, policy: Policy, *, pinned: Callable[[], set] | None = None,
                 clean_point: str = "retention", complete=None):
        self.policy = policy
        self.pinned = pinned
        self.on_commit: Callable[[Manifest], None] | None = None
        self.clean_point = clean_point
        super().__init__(directory, keep_full=policy.n if isinstance(policy, KeepLast) else 1, complete=complete)

    def _retain(self, manifest: Manifest) -> Manifest:
        pinned = self.pinned() if self.pinned is not None else frozenset()
        if self._complete is None:
            return self.policy.retain(manifest, pinned)
        return retain_sets(self.policy, manifest, pinned, self._complete(manifest.fulls))

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


def join_runs(local: CheckpointStore, shared: CheckpointStore) -> None:
    """Make both tiers one run: a tier without files takes the other's run (a replaced node's new,
    empty local directory continues the shared tier's run). Two different runs are refused."""
    local_files, shared_files = bool(local.manifest.files()), bool(shared.manifest.files())
    if not local_files:
        local.run = shared.run
    elif not shared_files:
        shared.run = local.run
    elif local.run != shared.run:
        refuse_runs(local, shared)


def refuse_runs(local: CheckpointStore, shared: CheckpointStore):
    raise CheckpointError(f"{shared.directory} holds run {shared.run}, {local.directory} run {local.run}: "
                          f"the shared tier belongs to another training run")


def check_layouts(partition: Partition | None, shared_root: str) -> None:
    """One tier never mixes the single-process and the partitioned layout."""
    single = os.path.exists(os.path.join(shared_root, MANIFEST_NAME))
    if partition is not None and single:
        raise CheckpointError(f"{shared_root} holds single-process checkpoints: a partitioned run (torch.distributed) "
                              f"cannot drain into it; name another shared_dir")
    if partition is None and is_partitioned(shared_root):
        raise CheckpointError(f"{shared_root} is partitioned (written under torch.distributed): a single-process "
                              f"run cannot drain into it; name another shared_dir")


def complete_in(partition: Partition, root: str):
    """``complete(fulls)`` of the same rank in the partitioned directory ``root`` (the shared tier):
    evaluated at each call, with the set's session as ``partition.join`` left it."""
    return lambda fulls: dataclasses.replace(partition, root=root).complete(fulls)


# ---------------------------------------------------------------------- TIERS.json
def write_marker(local_dir: str, tiers: Tiers, local_policy: Policy) -> None:
    """Record in the local directory where its shared tier is and each tier's policy (committed
    with fastio.Writer: temporary file, fdatasync, rename, directory fsync)."""
    body = {"version": TIERS_VERSION, "shared_dir": tiers.shared_dir, "local_policy": local_policy.describe(),
            "shared_policy": tiers.shared.describe(), "max_lag_steps": tiers.max_lag_steps}
    data = json.dumps(body, indent=1, sort_keys=True).encode()
    path = os.path.join(local_dir, TIERS_NAME)
    for name in os.listdir(local_dir):   # a writer killed mid-write left its temporary file
        if name.startswith(f".{TIERS_NAME}.tmp-") and is_dead_temp(name):
            try:
                os.unlink(os.path.join(local_dir, name))
            except FileNotFoundError:
                pass
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return
    except FileNotFoundError:
        pass
    with fastio.Writer(path, priority=fastio.URGENT) as writer:
        writer.write(data)


def read_marker(local_dir: str) -> dict | None:
    """The ``TIERS.json`` of ``local_dir`` (None: the directory has no shared tier)."""
    path = os.path.join(local_dir, TIERS_NAME)
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise CorruptCheckpointError(path, f"is not valid JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("version") != TIERS_VERSION or \
            not isinstance(body.get("shared_dir"), str):
        raise CorruptCheckpointError(path, f"is not a version {TIERS_VERSION} tier marker")
    return body

