"""The drainer: one background thread that copies every file the local tier commits to the shared
tier (through fastio) and commits it there — data durable, then the shared manifest replaced, then
its directory fsynced — then lets each tier's retention clean up.

Training never waits for it, unless the shared tier falls more than ``max_lag_steps`` committed
steps behind the local one: then ``throttle`` (called before each step) blocks until it has caught
up, and says so once. Files are copied in step order, so the shared tier's chains grow as the local
tier's did, and the local tier keeps (pins) every file not copied yet.

A copy error is sticky, like a write error of the local writers: ``check`` re-raises it in the
training thread on every call (the shared tier has stopped receiving checkpoints).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time

import numpy as np

import fastio
from lowdiff import faults
from lowdiff.distributed.partition import Partition, rank_directory
from lowdiff.errors import CheckpointError, CorruptCheckpointError
from lowdiff.store.manifest import FullEntry, Manifest, entry_path
from lowdiff.store.retention import Policy
from lowdiff.tiers.bucket import BucketStore
from lowdiff.tiers.bucketranks import (
    check_bucket_layout,
    complete_in_bucket,
    dropped_prefixes,
    durable_in_bucket,
    rank_url,
)
from lowdiff.tiers.marker import check_layouts, complete_in, join_runs, refuse_runs, write_marker
from lowdiff.tiers.objectstore import is_object_url
from lowdiff.tiers.policy import PolicyStore, Tiers
from lowdiff.tiers.unstripe import copy_unstriped, remove_dead_scratch, scratch_directory

log = logging.getLogger("lowdiff")
_CHUNK_BYTES = 8 << 20


def entry_end(entry) -> int:
    """The newest step a manifest entry holds."""
    return entry.step if isinstance(entry, FullEntry) else entry.last


def newest_step(manifest: Manifest) -> int:
    return max((entry_end(e) for e in manifest.fulls + manifest.batches), default=-1)


def copy_file(source: str, target: str, engine=None, verify: bool = True, timings: dict | None = None) -> int:
    """Copy ``source`` to ``target`` with fastio.Writer (temporary name, fdatasync, rename,
    directory fsync) and return the bytes copied. With ``verify`` the copy is checked before the
    rename: the temporary file is read back and its CRC-32C must equal that of the bytes read from
    ``source`` (CorruptCheckpointError naming ``target`` otherwise; nothing appears at ``target``).
    ``timings`` (optional) gets ``copy_s`` (read, write, fdatasync, rename) and ``verify_s`` (the
    read-back) added to it."""
    # One reused read buffer, deliberately one byte past a page boundary: fastio writes aligned
    # memory without copying and needs it unchanged until commit, so an aligned buffer could not
    # be refilled; a misaligned one is copied into fastio's staging ring at each write.
    raw = np.empty(_CHUNK_BYTES + 2 * fastio.ALIGN_BYTES, np.uint8)
    start = (-raw.ctypes.data) % fastio.ALIGN_BYTES + 1
    buffer = raw[start:start + _CHUNK_BYTES]
    view = buffer.data
    crc = 0
    verify_s = 0.0

    def check(written: str) -> None:
        nonlocal verify_s
        started = time.perf_counter()
        check_copy(written, target, writer.size, crc, engine)
        verify_s = time.perf_counter() - started

    started = time.perf_counter()
    with open(source, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        with fastio.Writer(target, size_hint=size, engine=engine) as writer:
            while n := f.readinto(view):
                if verify:
                    crc = fastio.crc32c(buffer[:n], crc)
                writer.write(buffer[:n])
            faults.point("drain-write")
            writer.commit(check=check if verify else None)
    if timings is not None:
        timings["copy_s"] = timings.get("copy_s", 0.0) + time.perf_counter() - started - verify_s
        timings["verify_s"] = timings.get("verify_s", 0.0) + verify_s
    return writer.size


def check_copy(path: str, target: str, nbytes: int, crc: int, engine=None) -> None:
    """Read ``path`` (the copy of ``target`` before its rename) back and compare its size and CRC-32C
    with what was written. Aligned reads into an aligned buffer go through O_DIRECT where the
    filesystem allows it, so the bytes come from the device rather than from the page cache."""
    chunk = fastio.aligned_buffer(_CHUNK_BYTES)
    found = 0
    with fastio.Reader(path, engine=engine) as reader:
        if reader.size != nbytes:
            raise CorruptCheckpointError(target, f"the copy in the shared tier is {reader.size} bytes, "
                                                 f"{nbytes} were written")
        for offset in range(0, nbytes, _CHUNK_BYTES):
            n = min(_CHUNK_BYTES, nbytes - offset)
            reader.read_into(offset, chunk.view(0, n))
            found = fastio.crc32c(chunk.view(0, n), found)
    if found != crc:
        raise CorruptCheckpointError(target, f"the copy in the shared tier reads back with CRC-32C {found:#010x}, "
                                             f"the bytes written have {crc:#010x}")


class Drainer:
    """Copies the local tier's committed files to the shared tier. Call order: ``throttle`` and
    ``check`` from the training thread at will; ``close`` once (drains what is committed), or
    ``stop`` (abandons the rest); both release the shared tier."""

    def __init__(self, local: PolicyStore, shared: PolicyStore | BucketStore, max_lag_steps: int, engine=None,
                 verify_copies: bool = True, failed: BaseException | None = None):
        """``failed``: the shared tier could not be opened (an object store that is unreachable,
        missing or denied): the error is raised by ``check`` like a copy error, nothing is copied,
        and the local tier keeps working until then."""
        self.local, self.shared = local, shared
        self.max_lag_steps = max_lag_steps
        self.verify_copies = verify_copies
        # An engine of its own: pieces queue in order within a priority, so copies to a slow
        # shared tier on the training's engine would hold up the local full checkpoints (BULK
        # too) behind them, and training would wait for the slow tier after all.
        self._engine = fastio.make_engine(engine.config if engine is not None else fastio.FastioConfig.from_env())
        self._cond = threading.Condition()
        self._local = local.listed()
        in_shared = shared.listed()
        self._done = set(in_shared.files())     # names committed to the shared tier (ever, this session)
        self._skipped: set = set()              # local files the shared policy would drop at once
        self._local_step = newest_step(self._local)
        self._shared_step = newest_step(in_shared)
        # Steps the drainer is done with, copied or skipped: what backpressure measures the lag
        # by. A file the shared policy skips is no work left, and if the newest ones were skipped,
        # waiting for the shared tier's own step to advance would wait for ever.
        self._handled_step = self._shared_step
        self._error: BaseException | None = failed
        self._closing = False
        self._warned = False
        # copy_s: reading the local file and writing, syncing and renaming the copy; verify_s:
        # reading the copy back (as many bytes again from the shared tier); commit_s: the shared
        # manifest's commit and cleaning, per file.
        self.stats = {"drained_files": 0, "drained_bytes": 0, "copy_s": 0.0, "verify_s": 0.0, "commit_s": 0.0,
                      "backpressure_waits": 0, "backpressure_s": 0.0}
        local.pinned = self._undrained
        local.on_commit = self._local_committed
        self._thread = threading.Thread(target=self._run, name="lowdiff-drainer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ called by the local store
    def _local_committed(self, manifest: Manifest) -> None:
        with self._cond:
            self._local = manifest
            self._local_step = max(self._local_step, newest_step(manifest))
            self._cond.notify_all()

    def _undrained(self) -> set:
        """Local files the shared tier does not hold yet (retention must keep them)."""
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
        return self._error is not None or not self._thread.is_alive()

    def check(self) -> None:
        """Re-raise the drainer's error (every call: the shared tier has stopped)."""
        if self._error is not None:
            raise self._error

    def durable_step(self) -> int:
        """The newest step a resume from the shared tier alone reaches now (what survives losing
        the local directory); -1 before its first commit."""
        return self.shared.durable_step()

    def snapshot(self) -> dict:
        with self._cond:
            out = {"shared_dir": self.shared.directory, "shared_step": self._shared_step,
                   "lag_steps": max(self._local_step - self._handled_step, 0), **self.stats}
        out["shared_durable_step"] = self.durable_step()   # (the store's lock, not under ours)
        return out

    def close(self) -> None:
        """Copy everything the local tier has committed, then stop; raise a copy error."""
        self._end(drain=True)
        self.check()

    def stop(self) -> None:
        """Stop without copying more (idempotent); releases the shared tier."""
        self._end(drain=False)

    def _end(self, drain: bool) -> None:
        with self._cond:
            self._closing = True
            if not drain:
                self._skipped |= self._local.files() - self._done
            self._cond.notify_all()
        self._thread.join()
        self._engine.close()
        self.shared.close()

    # ------------------------------------------------------------ drainer thread
    def _run(self) -> None:
        while self._error is None:
            entry = self._next()
            if entry is None:
                return
            try:
                self._drain(entry)
            except BaseException as exc:
                exc.add_note(f"lowdiff: copying {entry.file} to the shared tier {self.shared.directory} failed; "
                             f"the shared tier stops at step {self._shared_step}")
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return

    def _next(self):
        """The oldest local entry not yet copied (None: closing and nothing left)."""
        with self._cond:
            while True:
                pending = [e for e in self._local.fulls + self._local.batches
                           if e.file not in self._done and e.file not in self._skipped]
                if pending:
                    return min(pending, key=lambda e: (entry_end(e), isinstance(e, FullEntry)))
                if self._closing:
                    return None
                self._cond.wait()

    def _drain(self, entry) -> None:
        if not self.shared.would_keep(entry):
            self._skip(entry)
            return
        timings: dict = {}
        source = entry_path(self.local.directory, entry)   # (a batch on another drive: there)
        striped = bool(getattr(entry, "stripes", ()))
        try:
            if isinstance(self.shared, BucketStore) and striped:
                nbytes = self._upload_unstriped(source, entry, timings)
            elif isinstance(self.shared, BucketStore):
                nbytes = self.shared.receive(source, entry, timings)
            elif striped:   # copied as one unstriped checkpoint: the shared tier resumes alone
                nbytes = copy_unstriped(source, os.path.join(self.shared.directory, entry.file), check_copy,
                                        self._engine, verify=self.verify_copies, timings=timings)
            else:
                nbytes = copy_file(source, os.path.join(self.shared.directory, entry.file), self._engine,
                                   verify=self.verify_copies, timings=timings)
        except FileNotFoundError:
            with self._cond:
                if entry.file in self._local.files():
                    raise
            self._skip(entry)   # dropped by the local tier meanwhile (abandoned timeline)
            return
        if nbytes != entry.nbytes and not striped:
            raise CheckpointError(f"{entry.file} is {nbytes} bytes in {self.local.directory}, its manifest "
                                  f"says {entry.nbytes}")
        faults.point("drain-commit")
        committing = time.perf_counter()
        # The shared tier's entry: the file is there, whole (no stripes, no other drive).
        self.shared.commit_copied(dataclasses.replace(entry, nbytes=nbytes, stripes=()) if striped else
                                  dataclasses.replace(entry, dir=None) if getattr(entry, "dir", None) else entry)
        with self._cond:
            self._done.add(entry.file)
            self._done &= self._local.files() | self.shared.manifest.files()   # bounded by what is listed
            self._shared_step = max(self._shared_step, entry_end(entry))
            self._handled_step = max(self._handled_step, entry_end(entry))
            self.stats["drained_files"] += 1
            self.stats["drained_bytes"] += nbytes
            self.stats["copy_s"] += timings["copy_s"]
            self.stats["verify_s"] += timings["verify_s"]
            self._cond.notify_all()
        self.local.clean()   # the copied file is no longer pinned: the local policy may let it go
        with self._cond:
            self.stats["commit_s"] += time.perf_counter() - committing

    def _upload_unstriped(self, source: str, entry, timings: dict) -> int:
        """A striped full checkpoint into the bucket: gathered into one unstriped file (each
        stripe's CRC-32C checked) in the local tier's scratch directory, uploaded (read back when
        ``verify_copies``), removed (lowdiff.tiers.unstripe)."""
        assert isinstance(self.shared, BucketStore)
        scratch = scratch_directory(self.local.directory)
        try:
            copy = os.path.join(scratch, entry.file)
            copy_unstriped(source, copy, check_copy, self._engine, verify=False, timings=timings)
            return self.shared.receive(copy, entry, timings)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _skip(self, entry) -> None:
        with self._cond:
            self._skipped.add(entry.file)
            # Entries are taken oldest first, so every local step up to here is handled; an entry
            # of an abandoned timeline may end past the newest local step, hence the bound.
            self._handled_step = max(self._handled_step, min(entry_end(entry), self._local_step))
            self._cond.notify_all()


def open_tiers(directory: str, tiers: Tiers, retention: Policy, engine=None,
               partition: Partition | None = None, stripe_dirs=()) -> tuple[PolicyStore, Drainer]:
    """The local tier's store (``directory``) and the drainer to ``tiers.shared_dir``; both hold
    their directory's lock. ``retention``: the local tier's policy unless ``tiers.local`` names
    one (wrap's ``retention``). With ``partition`` (this rank of a partitioned run), the rank's
    directory of each tier: ``directory/rank-N`` drains into ``shared_dir/rank-N``, each tier's
    retention counting its own complete sets; ``partition.join`` (a collective) happens here.
    ``stripe_dirs``: the local tier's other drives (lowdiff.store.stripes); its striped full
    checkpoints are drained as unstriped ones (lowdiff.tiers.unstripe), its batches from their drive."""
    if is_object_url(tiers.shared_dir):
        return _open_bucket(directory, tiers, retention, engine, partition, stripe_dirs)
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
    local = PolicyStore(local_dir, tiers.local_policy(retention), complete=in_local, stripe_dirs=stripe_dirs)
    try:
        shared = PolicyStore(shared_dir, tiers.shared, clean_point="clean", complete=in_shared)
        try:
            join_runs(local, shared)
            if partition is not None:
                # Every rank takes rank 0's session and run (each tier of each rank already agreed
                # with the other tier, so this changes only the run of ranks whose tiers are new).
                partition.join(local, anchored=bool(local.manifest.files() or shared.manifest.files()))
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


def _open_bucket(directory: str, tiers: Tiers, retention: Policy, engine,
                 partition: Partition | None, stripe_dirs=()) -> tuple[PolicyStore, Drainer]:
    """``open_tiers`` for an object-store shared tier. A bucket that cannot be opened (missing,
    denied, unreachable) does not stop ``wrap``: the drainer starts failed, and its error is raised
    at the next step()/flush()/close(), like a copy error; the local tier keeps its checkpoints.
    With ``partition``, ``directory/rank-N`` drains into ``shared_dir/rank-N``; each rank's
    retention in the bucket counts the sets every rank's newest commit lists."""
    url = tiers.shared_dir
    in_shared = None if partition is None else complete_in_bucket(partition, url, tiers.object_store)
    in_local = None if partition is None or in_shared is None else \
        (lambda fulls: partition.complete(fulls) | _or_none(in_shared, fulls))
    local = PolicyStore(directory if partition is None else partition.directory, tiers.local_policy(retention),
                        complete=in_local, stripe_dirs=stripe_dirs)
    try:
        remove_dead_scratch(local.directory)   # (unstriped copies a killed drainer was uploading)
        shared = BucketStore(url if partition is None else rank_url(url, partition.rank), tiers.shared,
                             tiers.object_store, verify=tiers.verify_copies, complete=in_shared,
                             dropped=None if partition is None else
                             (lambda: dropped_prefixes(url, partition, tiers.object_store)),
                             durable=None if partition is None else
                             durable_in_bucket(partition, url, tiers.object_store))
        failed = None
        try:
            # (a prefix of the other layout fails wrap: every rank finds the same)
            check_bucket_layout(url, partition is not None, tiers.object_store)
            shared.open()
        except (OSError, CorruptCheckpointError) as exc:
            # A bucket that cannot be used now, or whose newest commit is damaged, fails the drain
            # (on this rank: the others still reach the collective below), not wrap.
            exc.add_note(f"lowdiff: the shared tier {url} cannot be opened; the local tier "
                         f"{local.directory} keeps its checkpoints")
            failed = exc
        if failed is None:
            join_runs(local, shared)    # type: ignore[arg-type]  # (a BucketStore has the run and manifest)
        if partition is not None:
            # As open_tiers does: every rank takes rank 0's session and run (a collective: every
            # rank comes here, its bucket opened or not).
            partition.join(local, anchored=bool(local.manifest.files() or shared.manifest.files()))
            if failed is None and shared.manifest.files() and shared.run != local.run:
                refuse_runs(local, shared)  # type: ignore[arg-type]
            shared.run = local.run
        write_marker(directory, tiers, local.policy)
        return local, Drainer(local, shared, tiers.max_lag_steps, engine, tiers.verify_copies, failed=failed)
    except BaseException:
        local.close()
        raise


def _or_none(complete, fulls) -> set:
    """``complete(fulls)``, or nothing when the bucket cannot be read now: the local tier keeps
    what it cannot prove complete (storage, never data), and its commits go on."""
    try:
        return complete(fulls)
    except (CheckpointError, OSError):
        return set()
