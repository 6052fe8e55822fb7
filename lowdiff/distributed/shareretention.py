"""Retention of the rank directories of ranks that no longer exist (a partitioned directory resumed
with fewer ranks): nobody writes them any more, so a live rank cleans them.

Rank directory ``rank-R/`` with R >= the world size is held (its LOCK) by live rank ``R mod W`` for
the session. Its shares belong to sets of earlier sessions, which are complete only together with
the shares the live ranks hold of the same sets; so after each commit that changes the live rank's
full checkpoints, the dropped directory keeps exactly the full shares of the sets the live rank
still lists, and the differential shares that continue them. Everything else is retired with the
one protocol (manifest committed first, naming the retired files, then deleted), so a crash leaves
nothing listed that a kept set needs and the next start finishes the deletions. Whatever the live
rank keeps — by its retention policy, e.g. the newest complete sets, older ones until ``KeepLast(n)``
has n newer complete sets — its dropped counterparts keep too (``follow``, in lowdiff.store.retention).

Once a dropped directory lists nothing and holds nothing but its manifest, lock and controller
measurements, it is removed (``remove_emptied``; docs/format.md, "Dropped ranks"), so a smaller
run leaves no empty rank directories behind; one a crash left half-removed goes at the next start.
"""
from __future__ import annotations

import logging
import os

from lowdiff import faults
from lowdiff.control.controlstate import CONTROLLER_NAME
from lowdiff.distributed.partition import Partition
from lowdiff.errors import CheckpointLockedError
from lowdiff.store.directory import LOCK_NAME, CheckpointStore
from lowdiff.store.manifest import MANIFEST_NAME, Manifest
from lowdiff.store.rankdirs import drive_of, rank_homes, remove_drive_record
from lowdiff.store.retention import KeepAll, follow

__all__ = ["DroppedRanks", "follow", "remove_emptied"]

log = logging.getLogger("lowdiff")


def remove_emptied(store: CheckpointStore, home: str | None = None) -> bool:
    """Remove the dropped rank directory ``store`` holds (its lock) when its manifest lists nothing
    and nothing but that manifest, the lock and the rank's controller measurements is in it; True
    when it is gone. Crash-safe order (docs/format.md, "Dropped ranks"): the measurements, the
    manifest, then the lock (still held: no other trainer can have taken the directory until it is
    unlinked), then ``rmdir``, which removes only an empty directory — a trainer that created its
    lock meanwhile keeps it. Every state a crash leaves is a rank directory listing nothing,
    removed again at the next start."""
    ours = (CONTROLLER_NAME, MANIFEST_NAME, LOCK_NAME)   # (in the order they go)
    if store.manifest.files():
        return False
    try:
        others = sorted(set(os.listdir(store.directory)) - set(ours))
    except FileNotFoundError:
        if home is not None:
            remove_drive_record(home)
        return True
    if others:   # files we cannot explain are never deleted (docs/format.md, "What may be deleted")
        log.warning("lowdiff: %s lists no checkpoint any more but holds %s; it is left in place",
                    store.directory, ", ".join(others[:4]) + (" ..." if len(others) > 4 else ""))
        return False
    for name in ours:
        try:
            os.unlink(os.path.join(store.directory, name))
        except FileNotFoundError:
            pass
        faults.point("dropped-clean")
    try:
        os.rmdir(store.directory)
    except FileNotFoundError:
        pass
    except OSError as exc:   # (ENOTEMPTY: another process started writing it)
        log.warning("lowdiff: %s was not removed: %s", store.directory, exc)
        return False
    if home is not None:
        remove_drive_record(home)
    log.info("lowdiff: removed %s, the emptied directory of a rank this run dropped", store.directory)
    return True


def stripe_directories(store: CheckpointStore) -> set:
    """The stripe directories of a rank directory (docs/format.md, "More drives than ranks"): the
    other drives' directories its listed stripes and batches are in, named as the rank directory."""
    name = os.path.basename(os.path.normpath(store.directory))
    dirs = {s.dir for f in store.manifest.fulls for s in f.stripes if s.dir is not None}
    dirs |= {b.dir for b in store.manifest.batches if getattr(b, "dir", None) is not None}
    return {d for d in dirs if os.path.basename(os.path.normpath(d)) == name}


class DroppedRanks:
    """The dropped rank directories this rank cleans; ``attach`` it to this rank's store."""

    def __init__(self, partition: Partition):
        self.stores: list[CheckpointStore] = []
        self._homes: dict = {}   # {store: its rank-NNNNN/ when that holds a DRIVE.json naming it}
        self._stripe_dirs: dict = {}   # {store: its stripe directories on other drives, removed after it}
        for rank, home in sorted(rank_homes(partition.root).items()):
            if rank >= partition.world and rank % partition.world == partition.rank:
                path = drive_of(home) or home
                if path != home and not os.path.isdir(path):   # removed from its drive before its DRIVE.json
                    remove_drive_record(home)
                    continue
                try:
                    # A dropped directory keeps what the live rank keeps (retention.follow, applied
                    # with keep_only); its store never commits an entry, so no policy of its own runs.
                    store = CheckpointStore(path, KeepAll())
                except CheckpointLockedError as exc:   # a process of the earlier job still runs
                    log.warning("lowdiff: %s; its old shares are not cleaned by this run", exc)
                    continue
                except FileNotFoundError:   # removed since it was listed (by another process)
                    continue
                store.clean_point = "dropped-clean"     # (lowdiff.faults)
                self.stores.append(store)
                self._stripe_dirs[id(store)] = stripe_directories(store)
                if path != home:
                    self._homes[id(store)] = home
        self._fulls: list | None = None
        self._remove_emptied()   # (left listing nothing by a crash in an earlier removal)

    def attach(self, store: CheckpointStore) -> None:
        if self.stores:
            store.after_commit.append(self._after_commit)

    def _after_commit(self, live: Manifest) -> None:
        if live.fulls == self._fulls:
            return   # a differential commit: no set came or went
        self._fulls = list(live.fulls)
        for store in self.stores:
            store.keep_only(lambda dropped: follow(dropped, live))
        self._remove_emptied()

    def _remove_emptied(self) -> None:
        """Let go of the dropped directories that list nothing (removing them when they hold
        nothing else): following the live rank only ever retires entries, so none is left to clean."""
        kept = []
        for store in self.stores:
            if store.manifest.files():
                kept.append(store)
            else:
                if remove_emptied(store, self._homes.get(id(store))):
                    for directory in self._stripe_dirs.get(id(store), ()):
                        try:
                            os.rmdir(directory)   # (only when empty: files we cannot explain stay)
                        except OSError:
                            pass
                store.close()
        self.stores = kept

    def close(self) -> None:
        for store in self.stores:
            store.close()
