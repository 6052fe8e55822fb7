"""Retention of the rank directories of ranks that no longer exist (a partitioned directory resumed
with fewer ranks): nobody writes them any more, so a live rank cleans them.

Rank directory ``rank-R/`` with R >= the world size is held (its LOCK) by live rank ``R mod W`` for
the session. Its shares belong to sets of earlier sessions, which are complete only together with
the shares the live ranks hold of the same sets; so after each commit that changes the live rank's
full checkpoints, the dropped directory keeps exactly the full shares of the sets the live rank
still lists, and the differential shares that continue them. Everything else is retired with the
one protocol (manifest committed first, naming the retired files, then deleted), so a crash leaves
nothing listed that a kept set needs and the next start finishes the deletions. Whatever the live
rank keeps — the newest complete sets, older ones until ``keep_full`` newer complete sets exist —
its dropped counterparts keep too.
"""
from __future__ import annotations

import dataclasses
import logging

from .errors import CheckpointLockedError
from .manifest import Manifest
from .partition import Partition, rank_directories
from .store import CheckpointStore

log = logging.getLogger("lowdiff")


def follow(dropped: Manifest, live: Manifest) -> Manifest:
    """``dropped`` keeping the full shares of the sets ``live`` lists and the differential shares
    of their sessions after the oldest of them (each kept set's chain)."""
    kept = {(f.step, f.session) for f in live.fulls}
    fulls = [f for f in dropped.fulls if (f.step, f.session) in kept]
    oldest: dict = {}
    for full in fulls:
        oldest[full.session] = min(full.step, oldest.get(full.session, full.step))
    batches = [b for b in dropped.batches if b.session in oldest and b.last > oldest[b.session]]
    return dataclasses.replace(dropped, fulls=fulls, batches=batches)


class DroppedRanks:
    """The dropped rank directories this rank cleans; ``attach`` it to this rank's store."""

    def __init__(self, partition: Partition, keep_full: int):
        self.stores: list[CheckpointStore] = []
        for rank, path in sorted(rank_directories(partition.root).items()):
            if rank >= partition.world and rank % partition.world == partition.rank:
                try:
                    store = CheckpointStore(path, keep_full)
                except CheckpointLockedError as exc:   # a process of the earlier job still runs
                    log.warning("lowdiff: %s; its old shares are not cleaned by this run", exc)
                    continue
                store.clean_point = "dropped-clean"     # (lowdiff.faults)
                self.stores.append(store)
        self._fulls: list | None = None

    def attach(self, store: CheckpointStore) -> None:
        if self.stores:
            store.after_commit.append(self._after_commit)

    def _after_commit(self, live: Manifest) -> None:
        if live.fulls == self._fulls:
            return   # a differential commit: no set came or went
        self._fulls = list(live.fulls)
        for store in self.stores:
            store.keep_only(lambda dropped: follow(dropped, live))

    def close(self) -> None:
        for store in self.stores:
            store.close()
