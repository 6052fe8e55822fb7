"""Background persistence. The training thread hands over immutable records and snapshots; two
threads turn them into committed files: one for differential batches (small, latency-sensitive,
URGENT priority in fastio) and one for full checkpoints (large, BULK), so a differential batch is
never queued behind a full checkpoint. Errors are kept and re-raised, with their original type, in
the training thread by ``check`` (lowdiff calls it at the start of every ``step``, and in ``flush`` and
``close``) — every time, not once: after a failed write the steps recorded since are not on disk, and
checkpointing stays stopped until the optimizer is closed."""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
import warnings

import torch

from lowdiff import faults
from lowdiff.format.batchfile import write_batch
from lowdiff.format.fullckpt import Snapshot
from lowdiff.format.records import encode_record
from lowdiff.format.schema import TrainedWith
from lowdiff.persist.pinned import PinnedStaging
from lowdiff.persist.threads import ErrorSlot, Worker
from lowdiff.store.stripes import remove_stripes

_RECHECK = object()   # put() blocked: close the batch if the records held already fill one


@dataclasses.dataclass(frozen=True)
class _BatchEnd:
    step: int             # no batch spans this step: one ends there (see DiffWriter.end_batch_at)


class DiffWriter:
    """Encodes records as they arrive and writes a batch file every ``batch_steps`` records or
    when sealed. At most ``max_pending_steps`` records may be recorded but not yet durable: beyond
    that ``put`` blocks (backpressure), which bounds what a crash can lose."""

    def __init__(self, store, controller, max_pending_batches: int, engine=None, batch_format=None,
                 drop_covered: bool = False):
        """``batch_format``: an object with ``encode(record)`` and ``write_batch(path, session,
        records, run=, engine=)`` used instead of the plain record and batch file (a share of a
        partitioned directory, lowdiff.distributed.partition). ``drop_covered`` (replica mode): records of
        steps that a full checkpoint this session committed already holds are dropped before
        their batch is written; the next batch then starts right after that checkpoint. Records
        are then kept as handed over and encoded only when their batch is written (their
        ``release`` is called after that, or when they are dropped)."""
        self.store = store
        self._drop_covered = drop_covered
        self.steps_dropped = 0           # records dropped because a full checkpoint covered them
        self._encode = encode_record if batch_format is None else batch_format.encode
        self._write_batch = write_batch if batch_format is None else batch_format.write_batch
        self.controller = controller
        self.max_pending_batches = max_pending_batches
        self._engine = engine
        self._queue: queue.Queue = queue.Queue()
        self._pending_steps = 0          # recorded, not yet durable (or dropped after an error)
        self._room = threading.Condition()
        self._errors = ErrorSlot(store.durable_step)
        self._thread = threading.Thread(target=self._run, name="lowdiff-diff-writer", daemon=True)
        self._thread.start()

    def put(self, record, release=None) -> None:
        """Queue ``record`` (blocks while too many steps are not yet durable). Never raises a
        background error: the caller checks before it changes state (``check``). ``release()``
        is called (on the writer thread) once the record's tensors are no longer needed."""
        with self._room:
            while self._pending_steps >= self.max_pending_batches * self.controller.batch_steps:
                # The writer closes a batch when an arriving record finds ``batch_steps`` pending. If
                # ``batch_steps`` shrank since (the controller), the records held may fill a batch
                # already, and no arrival says so: ask it to look again, or both threads wait.
                self._queue.put(_RECHECK)
                self._room.wait()
            self._pending_steps += 1
        self._queue.put((record, release))

    def _release(self, steps: int) -> None:
        with self._room:
            self._pending_steps -= steps
            self._room.notify_all()

    def end_batch_at(self, step: int) -> None:
        """A full checkpoint of ``step`` is being taken: no batch written from now on spans ``step``
        (the chain from that checkpoint must find a batch that starts at ``step + 1``, whichever
        commits first). Unlike ``seal`` nothing is written now. Call it right after ``put`` of the
        record of ``step``, on the same thread."""
        self._queue.put(_BatchEnd(step))

    def seal(self) -> threading.Event:
        """Close the current batch (write it even if partial); the event is set when it is durable.
        Nothing put and not yet durable: nothing to close, and the writer is not woken for it."""
        done = threading.Event()
        with self._room:
            if not self._pending_steps:
                done.set()
        if not done.is_set():
            self._queue.put(done)
        return done

    def check(self) -> None:
        """Raise the background error, if any (every call)."""
        self._errors.check()

    def flush(self) -> None:
        self.seal().wait()
        self._errors.check()

    def close(self) -> None:
        if self._thread.is_alive():
            self.seal().wait()
            self._queue.put(None)
            self._thread.join()
        self._errors.check()

    def _run(self) -> None:
        pending: list[_Pending] = []
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                self._write(pending)
                pending = []
                item.set()
                continue
            if isinstance(item, _BatchEnd):
                if pending and pending[-1].step == item.step:
                    pending[-1].ends_batch = True
                continue
            if item is _RECHECK:
                pending = self._without_covered(pending)
                if pending and len(pending) >= self.controller.batch_steps:
                    self._write(pending)
                    pending = []
                continue
            record, release = item
            if self._drop_covered and self._errors.error is None:
                # Most of these records are dropped: encode (copy) only those a batch will hold.
                pending.append(_Pending(record.step, record, release))
            else:
                try:
                    if self._errors.error is None:
                        pending.append(_Pending(record.step, self._encoded(record), None))
                except BaseException as exc:
                    self._errors.error = exc
                finally:
                    if release is not None:
                        release()
            pending = self._without_covered(pending)
            if len(pending) >= self.controller.batch_steps:
                self._write(pending)
                pending = []
            elif self._errors.error is not None:
                self._release(1)

    def _encoded(self, record) -> list:
        if record.ready is not None:
            record.ready()   # its gradients' device-to-host copies have landed (capture.devicecopy)
        self.controller.maybe_time_decode(encoded := self._encode(record))  # the decode half of replay's cost
        return encoded

    def _without_covered(self, pending: list) -> list:
        """``pending`` without the records a committed full checkpoint of this session holds (with
        ``drop_covered``). Records are consecutive, so the covered ones are a prefix and the rest
        continue that checkpoint."""
        if not self._drop_covered or not pending:
            return pending
        covered = self.store.newest_full_step(since=pending[0].step)
        dropped = 0
        while dropped < len(pending) and pending[dropped].step <= covered:
            dropped += 1
        if not dropped:
            return pending
        self.steps_dropped += dropped
        _let_go(pending[:dropped])
        self._release(dropped)
        return pending[dropped:]

    def _write(self, pending: list) -> None:
        """Write ``pending`` as one batch, or one per stretch that ends at a ``_BatchEnd``."""
        pending = self._without_covered(pending)
        try:
            start = 0
            for end, entry in enumerate(pending, 1):
                if entry.ends_batch or end == len(pending):
                    self._write_one(pending[start:end])
                    start = end
        except BaseException as exc:
            self._errors.error = exc
        finally:
            _let_go(pending)   # after the write: encoded buffers may be views of the record's tensors
            self._release(len(pending))

    def _write_one(self, pending: list) -> None:
        if self._errors.error is not None:
            return
        records = [(p.step, p.payload if p.release is None else self._encoded(p.payload)) for p in pending]
        started = time.perf_counter()
        first, last = pending[0].step, pending[-1].step
        path = self.store.batch_path(first, last)
        nbytes = self._write_batch(path, self.store.session, records, run=self.store.run, engine=self._engine)
        faults.point("batch-commit")
        self.store.commit_batch(first, last, path, nbytes)
        self.controller.batch_written(len(pending), time.perf_counter() - started, nbytes)


@dataclasses.dataclass
class _Pending:
    """A record waiting for its batch: encoded buffers, or (``drop_covered``) the record itself,
    whose tensors its owner lends until ``release()``."""
    step: int
    payload: object
    release: object = None
    ends_batch: bool = False      # a full checkpoint is taken at this step: no batch goes past it


def _let_go(pending: list) -> None:
    for entry in pending:
        if entry.release is not None:
            entry.release()
            entry.release = None


class _BackgroundCopy:
    """A snapshot being copied on the persist thread: ``copied`` is set when the copy has ended;
    then the training thread decides whether it may be committed."""

    def __init__(self):
        self.copied = threading.Event()
        self._decided = threading.Event()
        self.ok = False

    def decide(self, ok: bool) -> None:
        self.ok = ok
        self._decided.set()

    def may_commit(self) -> bool:
        self._decided.wait()
        return self.ok


class FullWriter:
    """Persists one full checkpoint at a time from a reused staging snapshot.

    With ``background_copy`` the training thread only stages the snapshot (tensor references and
    version counters); the copy into staging runs on the persist thread while training goes on
    with the next forward/backward pass. ``release()`` must be called on the training thread
    before anything may modify the state (lowdiff calls it before each optimizer step, and in
    flush/close): it waits for the copy, then commits the checkpoint only if no staged tensor was
    modified in place meanwhile. A modified one means state changed outside ``step()``: that
    checkpoint is discarded with a warning and later ones are copied on the training thread.
    """

    def __init__(self, store, controller, engine=None, background_copy: bool = True, snapshot=None):
        """``snapshot``: the staging snapshot to reuse (default a whole-checkpoint ``Snapshot``; a
        ``ShareSnapshot`` in a partitioned directory)."""
        self.store = store
        self.controller = controller
        self._engine = engine
        self.background_copy = background_copy
        self._snapshot = snapshot if snapshot is not None else Snapshot()
        # CUDA state: copied off the training thread through a bounded pinned ring (persist.pinned).
        self._pinned = PinnedStaging() if torch.cuda.is_available() and self._snapshot.supports_device_copy else None
        if self._pinned is not None:
            self._snapshot.device_copy = self._pinned
        self._worker = Worker("lowdiff-full-writer")
        self._errors = ErrorSlot(store.durable_step)
        self._pending_copy: _BackgroundCopy | None = None
        self._stall_s = 0.0

    def take(self, step: int, state: dict, meta: TrainedWith, base: bool) -> None:
        """Stage ``state`` and persist it in the background; the copy into staging happens here
        (blocking) or, with ``background_copy``, on the persist thread. Waits first for the
        previous persist (its staging memory is reused)."""
        self._quiesce()
        if self._errors.error is not None:
            return  # checkpointing has stopped (see check)
        started = time.perf_counter()
        self._snapshot.stage(step, state, meta)
        background = self.background_copy and not base and self._snapshot.copyable_in_background()
        if background:
            self._pending_copy = _BackgroundCopy()
            if self._pinned is not None:
                self._pinned.mark(self._snapshot.staged_tensors())
        else:
            self._snapshot.copy(on_training_thread=True)
            self._snapshot.release_sources()
        self._stall_s = time.perf_counter() - started
        if not background:
            self.controller.full_taken(self._stall_s)
        pending = self._pending_copy
        self._worker.submit(lambda: self._persist(step, base, pending))

    def release(self) -> None:
        """Training thread: wait for a background copy to end and judge it (see the class doc)."""
        pending, self._pending_copy = self._pending_copy, None
        if pending is None:
            return
        started = time.perf_counter()
        pending.copied.wait()
        self._snapshot.wait_landed()   # device copies the persist thread may still be writing out
        modified = self._snapshot.modified_since_stage()
        self._snapshot.release_sources()
        pending.decide(not modified)
        self.controller.full_taken(self._stall_s + time.perf_counter() - started)
        if modified:
            self.background_copy = False
            shown = ", ".join(modified[:3]) + (f" and {len(modified) - 3} more" if len(modified) > 3 else "")
            warnings.warn(
                f"lowdiff: {shown} changed in place after step {self._snapshot.step} outside optimizer.step(); "
                f"the full checkpoint of step {self._snapshot.step} is discarded and later ones are copied "
                f"before step() returns.", RuntimeWarning, stacklevel=4)

    def prepare(self, payload_bytes: int) -> None:
        """Pre-fault staging for the next full checkpoint in the background."""
        def run():
            try:
                self._snapshot.prepare(payload_bytes)
            except BaseException as exc:
                self._errors.error = exc
        self._quiesce()
        if self._errors.error is None:
            self._worker.submit(run)

    def _persist(self, step: int, base: bool, pending: _BackgroundCopy | None) -> None:
        if self._errors.error is not None:
            if pending is not None:
                pending.copied.set()
            return
        try:
            started = time.perf_counter()
            if pending is not None:
                try:
                    self._snapshot.copy(on_training_thread=False)
                finally:
                    pending.copied.set()
            path = self.store.full_path(step)
            devices = self.store.stripes
            written: list = []   # the stripes written, for the manifest
            stripe = None
            if devices is not None:
                def stripe(payload):
                    unit, stripes = devices.write(step, self.store.session, payload)
                    written[:] = stripes
                    return unit, stripes
            try:
                nbytes = self._snapshot.persist(path, self.store.session, run=self.store.run, engine=self._engine,
                                                before_commit=pending.may_commit if pending is not None else None,
                                                stripe=stripe)
            except BaseException:
                remove_stripes(self.store.directory, written)   # no committed file names them
                raise
            if nbytes is None:
                remove_stripes(self.store.directory, written)   # named by nothing
                return  # discarded: the training thread saw the state change during the copy
            faults.point("full-commit")
            self.store.commit_full(step, path, nbytes, base=base, stripes=tuple(written))
            self.controller.full_persisted(time.perf_counter() - started, nbytes)
        except BaseException as exc:
            self._errors.error = exc

    def busy(self) -> bool:
        return self._worker.busy()

    def _quiesce(self) -> None:
        """Training thread: release any background copy, then wait for the persist to end."""
        self.release()
        self._worker.wait()

    def wait(self) -> None:
        self._quiesce()   # then raise a background error
        self._errors.check()

    def check(self) -> None:
        self._errors.check()   # the background error, if any (every call)

    def close(self) -> None:
        """Training thread: ``wait``, end the worker thread, let staging go (page-locked for device
        copies: unlocked; registered with the I/O engine, which would keep it alive: released)."""
        try:
            self.wait()
        finally:
            self._worker.close()
            if self._pinned is not None:
                self._snapshot.drop_buffer()
            else:
                self._snapshot.release_fixed()
