"""The drainer: copies every file the local tier commits to the shared tier (through fastio) and
commits it there — data durable and read back, renamed, then the shared manifest replaced and its
directory fsynced — then lets each tier's retention clean up.

Two threads share the work: the copier writes each file's copy and makes it durable under a
temporary name (lowdiff.tiercopy.stage_copy); the publisher reads it back, renames it into place and
commits the shared manifest (tiercopy.publish, then commit_copied), in the order the copier took the
files. So the read-back of one file runs while the next one is copied: on a shared file system whose
reads and writes have separate budgets the drain takes about the longer of the two, not their sum.

Why between files and not between the chunks of one file: a copy is still read back only once it is
durable (after its fdatasync), as before, where chunks read back while the rest is being written
would not be; fastio needs only its commit split in two (Writer.sync, then commit); and the local
tier commits a file every few steps (a full checkpoint, then a batch per ``batch_steps``), so the
next file is nearly always there to copy. What it does not shorten is one lone file's way to the
shared tier (the last one at ``close``).

Training never waits for it, unless the shared tier falls more than ``max_lag_steps`` committed
steps behind the local one: then ``throttle`` (called before each step) blocks until it has caught
up, and says so once. Files are committed in step order, so the shared tier's chains grow as the
local tier's did, and the local tier keeps (pins) every file until the shared tier has committed it.

A copy error is sticky, like a write error of the local writers: ``check`` re-raises it in the
training thread on every call (the shared tier has stopped receiving checkpoints); copies made after
the failed one are removed, not published.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time

import fastio

from . import faults, tiercopy
from .errors import CheckpointError
from .manifest import BatchEntry, FullEntry, Manifest
from .partition import Partition, rank_directory
from .tiers import PolicyStore, Tiers, check_layouts, complete_in, join_runs, refuse_runs, write_marker

log = logging.getLogger("lowdiff")
# How far the copier may run ahead of the publisher: copies durable but not yet read back, each
# holding a file descriptor and space in the shared tier. Enough for a full checkpoint and the
# differential batches after it (the publisher reads the full checkpoint back while the copier
# writes them and the next full checkpoint); at least one file whatever its size.
_AHEAD_BYTES = 1 << 30
_AHEAD_FILES = 64


def entry_end(entry) -> int:
    """The newest step a manifest entry holds."""
    return entry.step if isinstance(entry, FullEntry) else entry.last


def newest_step(manifest: Manifest) -> int:
    return max((entry_end(e) for e in manifest.fulls + manifest.batches), default=-1)


@dataclasses.dataclass
class _Copied:
    """What the copier hands the publisher for one local entry: its copy, or None when there is
    nothing to publish (the shared policy would drop it at once, or the local tier dropped it)."""

    entry: FullEntry | BatchEntry
    staged: tiercopy.Staged | None


class Drainer:
    """Copies the local tier's committed files to the shared tier. Call order: ``throttle`` and
    ``check`` from the training thread at will; ``close`` once (drains what is committed), or
    ``stop`` (abandons the rest); both release the shared tier."""

    def __init__(self, local: PolicyStore, shared: PolicyStore, max_lag_steps: int, engine=None,
                 verify_copies: bool = True):
        self.local, self.shared = local, shared
        self.max_lag_steps = max_lag_steps
        self.verify_copies = verify_copies
        config = engine.config if engine is not None else fastio.FastioConfig.from_env()
        # Engines of its own: pieces queue in order within a priority, so copies to a slow shared
        # tier on the training's engine would hold up the local full checkpoints (BULK too) behind
        # them, and training would wait for the slow tier after all. For the same reason the
        # read-backs have a second one: on the copies' engine each read would queue behind the
        # next file's writes, and the two would not overlap.
        self._engine = fastio.make_engine(config)
        self._read_engine = fastio.make_engine(config) if verify_copies else None
        self._cond = threading.Condition()
        self._local = local.listed()
        in_shared = shared.listed()
        self._done = set(in_shared.files())     # names committed to the shared tier (ever, this session)
        self._skipped: set = set()              # local files the shared policy would drop at once
        self._taken: set = set()                # names the copier took that the publisher has not finished
        self._queue: collections.deque = collections.deque()   # _Copied, copier -> publisher, in order
        self._unpublished = [0, 0]              # files and bytes taken and not finished (the bound)
        # Entries being copied or waiting to be published, in order: the copier judges the next
        # entry as if they were listed (PolicyStore.would_keep). ``_listing`` makes a shared commit
        # and the removal of its entry from here one step for that judgement.
        self._ahead: list = []
        self._listing = threading.Lock()
        self._local_step = newest_step(self._local)
        self._shared_step = newest_step(in_shared)
        # Steps the drainer is done with, published or skipped: what backpressure measures the lag
        # by. A file the shared policy skips is no work left, and if the newest ones were skipped,
        # waiting for the shared tier's own step to advance would wait for ever.
        self._handled_step = self._shared_step
        self._error: BaseException | None = None
        self._closing = False
        self._abandoned = False
        self._copier_done = False
        self._warned = False
        self._active = 0                        # threads working now (for busy_s)
        self._busy_since = 0.0
        # copy_s: reading local files and writing and syncing their copies (copier); verify_s:
        # reading the copies back, as many bytes again from the shared tier; commit_s: renaming,
        # the shared manifest's commit and cleaning, per file (publisher). The two threads overlap,
        # so these add up to more than the time spent: busy_s is the wall time during which at
        # least one of them was working.
        self.stats = {"drained_files": 0, "drained_bytes": 0, "copy_s": 0.0, "verify_s": 0.0, "commit_s": 0.0,
                      "busy_s": 0.0, "backpressure_waits": 0, "backpressure_s": 0.0}
        local.pinned = self._undrained
        local.on_commit = self._local_committed
        self._copier = threading.Thread(target=self._copy_loop, name="lowdiff-drainer", daemon=True)
        self._publisher = threading.Thread(target=self._publish_loop, name="lowdiff-drainer-publish", daemon=True)
        self._publisher.start()
        self._copier.start()

    # ------------------------------------------------------------ called by the local store
    def _local_committed(self, manifest: Manifest) -> None:
        with self._cond:
            self._local = manifest
            self._local_step = max(self._local_step, newest_step(manifest))
            self._cond.notify_all()

    def _undrained(self) -> set:
        """Local files the shared tier has not committed yet (retention must keep them)."""
        with self._cond:
            return self._local.files() - self._done - self._skipped

    # ------------------------------------------------------------ training thread
    def lag_steps(self) -> int:
        with self._cond:
            return max(self._local_step - self._handled_step, 0)

    def throttle(self) -> None:
        """Block while the shared tier is more than ``max_lag_steps`` behind (backpressure)."""
        with self._cond:
            if self._local_step - self._handled_step <= self.max_lag_steps or self._stopped():
                return
            if not self._warned:
                self._warned = True
                log.warning("lowdiff: the shared tier %s is %d steps behind the local one (max_lag_steps=%d); "
                            "training waits for the drainer (said once)", self.shared.directory,
                            self._local_step - self._handled_step, self.max_lag_steps)
            started = time.perf_counter()
            while self._local_step - self._handled_step > self.max_lag_steps and not self._stopped():
                self._cond.wait()
            self.stats["backpressure_waits"] += 1
            self.stats["backpressure_s"] += time.perf_counter() - started

    def _stopped(self) -> bool:
        return self._error is not None or not self._publisher.is_alive()

    def check(self) -> None:
        """Re-raise the drainer's error (every call: the shared tier has stopped)."""
        if self._error is not None:
            raise self._error

    def snapshot(self) -> dict:
        with self._cond:
            stats = dict(self.stats)
            if self._active:
                stats["busy_s"] += time.perf_counter() - self._busy_since
            return {"shared_dir": self.shared.directory, "shared_step": self._shared_step,
                    "lag_steps": max(self._local_step - self._handled_step, 0), **stats}

    def close(self) -> None:
        """Copy everything the local tier has committed, then stop; raise a copy error."""
        self._end(drain=True)
        self.check()

    def stop(self) -> None:
        """Stop without copying more (idempotent): the file being published is finished, copies
        not yet published are removed; releases the shared tier."""
        self._end(drain=False)

    def _end(self, drain: bool) -> None:
        with self._cond:
            self._closing = True
            if not drain:
                self._abandoned = True
                self._skipped |= self._local.files() - self._done
            self._cond.notify_all()
        self._copier.join()
        self._publisher.join()
        self._drop_queued()   # none are left by then; a copy must never outlive its drainer
        self._engine.close()
        if self._read_engine is not None:
            self._read_engine.close()
        self.shared.close()

    # ------------------------------------------------------------ both threads
    def _busy(self, delta: int) -> None:
        """A thread starts (+1) or ends (-1) a piece of work: busy_s accrues while any works."""
        with self._cond:
            now = time.perf_counter()
            if self._active == 0:
                self._busy_since = now
            self._active += delta
            if self._active == 0:
                self.stats["busy_s"] += now - self._busy_since

    def _fail(self, exc: BaseException, entry) -> None:
        """Record the first error (sticky); both threads stop at their next turn."""
        what = entry.file if entry is not None else "the next file"
        exc.add_note(f"lowdiff: copying {what} to the shared tier {self.shared.directory} failed; "
                     f"the shared tier receives nothing from it on")
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _finished(self, entry) -> None:
        """Bookkeeping once the publisher is done with ``entry`` (call with ``_cond`` held)."""
        self._taken.discard(entry.file)
        self._unpublished[0] -= 1
        self._unpublished[1] -= entry.nbytes
        self._cond.notify_all()

    def _drop_queued(self) -> None:
        with self._cond:
            dropped = list(self._queue)
            self._queue.clear()
        for item in dropped:
            if item.staged is not None:
                item.staged.abort()

    # ------------------------------------------------------------ copier thread
    def _copy_loop(self) -> None:
        entry = None
        try:
            while (entry := self._next()) is not None:
                self._busy(+1)
                try:
                    item = self._copy(entry)
                finally:
                    self._busy(-1)
                if not self._hand_over(item):
                    return
        except BaseException as exc:
            self._fail(exc, entry)
        finally:
            with self._cond:
                self._copier_done = True
                self._cond.notify_all()

    def _next(self):
        """The oldest local entry nobody has taken yet, once the bound leaves room for it (None:
        stopping, or closing and nothing left)."""
        with self._cond:
            while self._error is None and not self._abandoned:
                pending = [e for e in self._local.fulls + self._local.batches
                           if e.file not in self._done and e.file not in self._skipped and e.file not in self._taken]
                if pending:
                    entry = min(pending, key=lambda e: (entry_end(e), isinstance(e, FullEntry)))
                    files, nbytes = self._unpublished
                    if files == 0 or (files < _AHEAD_FILES and nbytes + entry.nbytes <= _AHEAD_BYTES):
                        self._taken.add(entry.file)
                        self._unpublished[0] += 1
                        self._unpublished[1] += entry.nbytes
                        return entry
                elif self._closing:
                    return None
                self._cond.wait()
            return None

    def _copy(self, entry) -> _Copied:
        with self._listing:
            keep = self.shared.would_keep(entry, self._ahead)
            if keep:
                self._ahead.append(entry)
        if not keep:
            return _Copied(entry, None)
        try:
            staged = tiercopy.stage_copy(os.path.join(self.local.directory, entry.file),
                                         os.path.join(self.shared.directory, entry.file), self._engine,
                                         verify=self.verify_copies)
        except FileNotFoundError:
            with self._listing:
                self._ahead.remove(entry)
            with self._cond:
                if entry.file in self._local.files():
                    raise
            return _Copied(entry, None)   # dropped by the local tier meanwhile (abandoned timeline)
        if staged.nbytes != entry.nbytes:
            staged.abort()
            raise CheckpointError(f"{entry.file} is {staged.nbytes} bytes in {self.local.directory}, its manifest "
                                  f"says {entry.nbytes}")
        with self._cond:
            self.stats["copy_s"] += staged.copy_s
        return _Copied(entry, staged)

    def _hand_over(self, item: _Copied) -> bool:
        """Queue ``item`` for the publisher; False (and the copy removed) once the drain stopped."""
        with self._cond:
            if self._error is None and not self._abandoned:
                self._queue.append(item)
                self._cond.notify_all()
                return True
        if item.staged is not None:
            item.staged.abort()
        return False

    # ------------------------------------------------------------ publisher thread
    def _publish_loop(self) -> None:
        try:
            while (item := self._take()) is not None:
                self._busy(+1)
                try:
                    self._publish(item)
                except BaseException as exc:
                    if item.staged is not None:
                        item.staged.abort()   # (a no-op once renamed: then it is adopted at the next start)
                    self._fail(exc, item.entry)
                    return
                finally:
                    self._busy(-1)
        finally:
            self._drop_queued()

    def _take(self) -> _Copied | None:
        with self._cond:
            while self._error is None and not self._abandoned:
                if self._queue:
                    return self._queue.popleft()
                if self._copier_done:
                    return None
                self._cond.wait()
            return None

    def _publish(self, item: _Copied) -> None:
        entry = item.entry
        if item.staged is None:
            self._skip(entry)
            return
        started = time.perf_counter()
        verify_s = tiercopy.publish(item.staged, self._read_engine, verify=self.verify_copies)
        faults.point("drain-commit")
        with self._listing:
            self.shared.commit_copied(entry)
            self._ahead.remove(entry)
        with self._cond:
            self._done.add(entry.file)
            self._done &= self._local.files() | self.shared.manifest.files()   # bounded by what is listed
            self._shared_step = max(self._shared_step, entry_end(entry))
            self._handled_step = max(self._handled_step, entry_end(entry))
            self.stats["drained_files"] += 1
            self.stats["drained_bytes"] += item.staged.nbytes
            self.stats["verify_s"] += verify_s
            self._finished(entry)
        self.local.clean()   # the published file is no longer pinned: the local policy may let it go
        with self._cond:
            self.stats["commit_s"] += time.perf_counter() - started - verify_s

    def _skip(self, entry) -> None:
        with self._cond:
            self._skipped.add(entry.file)
            # Entries are published oldest first, so every local step up to here is handled; an
            # entry of an abandoned timeline may end past the newest local step, hence the bound.
            self._handled_step = max(self._handled_step, min(entry_end(entry), self._local_step))
            self._finished(entry)


def open_tiers(directory: str, tiers: Tiers, keep_full: int, engine=None,
               partition: Partition | None = None) -> tuple[PolicyStore, Drainer]:
    """The local tier's store (``directory``) and the drainer to ``tiers.shared_dir``; both hold
    their directory's lock. With ``partition`` (this rank of a partitioned run), the rank's
    directory of each tier: ``directory/rank-N`` drains into ``shared_dir/rank-N``, each tier's
    retention counting its own complete sets; ``partition.join`` (a collective) happens here."""
    local_dir = directory if partition is None else partition.directory
    shared_dir = tiers.shared_dir if partition is None else rank_directory(tiers.shared_dir, partition.rank)
    if os.path.realpath(directory) == os.path.realpath(tiers.shared_dir):
        raise ValueError(f"shared_dir={tiers.shared_dir!r} is the local checkpoint directory itself")
    check_layouts(partition, tiers.shared_dir)
    in_shared = None if partition is None else complete_in(partition, tiers.shared_dir)
    in_local = None if partition is None or in_shared is None else \
        (lambda fulls: partition.complete(fulls) | in_shared(fulls))
    # (A set is complete for the local tier when it is complete there or in the shared tier: ranks
    # on other nodes keep their local rank directories where this rank cannot see them, but every
    # share in the shared tier was committed locally first.)
    local = PolicyStore(local_dir, tiers.local_policy(keep_full), complete=in_local)
    try:
        shared = PolicyStore(shared_dir, tiers.shared, clean_point="clean", complete=in_shared)
        try:
            join_runs(local, shared)
            if partition is not None:
                # Every rank takes rank 0's session and run (each tier of each rank already agreed
                # with the other tier, so this changes only the run of ranks whose tiers are new).
                partition.join(local)
                if shared.manifest.files() and shared.run != local.run:
                    refuse_runs(local, shared)
                shared.run = local.run
            write_marker(directory, tiers, local.policy)
            return local, Drainer(local, shared, tiers.max_lag_steps, engine, tiers.verify_copies)
        except BaseException:
            shared.close()
            raise
    except BaseException:
        local.close()
        raise
