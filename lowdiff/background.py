"""Background persistence. The training thread hands over immutable records and snapshots; two
threads turn them into committed files: one for differential batches (small, latency-sensitive,
URGENT priority in fastio) and one for full checkpoints (large, BULK), so a differential batch is
never queued behind a full checkpoint. Errors are kept and re-raised, with their original type, in
the training thread at the next ``put``/``flush``/``close``."""
from __future__ import annotations

import queue
import threading
import time

from .batchfile import write_batch
from .fullckpt import Snapshot
from .records import encode_record


class _ErrorSlot:
    def __init__(self):
        self.error: BaseException | None = None

    def check(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error


class DiffWriter:
    """Encodes records as they arrive and writes a batch file every ``batch_steps`` records or
    when sealed. At most ``max_pending_steps`` records may be recorded but not yet durable: beyond
    that ``put`` blocks (backpressure), which bounds what a crash can lose."""

    def __init__(self, store, controller, max_pending_batches: int, engine=None):
        self.store = store
        self.controller = controller
        self.max_pending_batches = max_pending_batches
        self._engine = engine
        self._queue: queue.Queue = queue.Queue()
        self._pending_steps = 0          # recorded, not yet durable (or dropped after an error)
        self._room = threading.Condition()
        self._errors = _ErrorSlot()
        self._thread = threading.Thread(target=self._run, name="lowdiff-diff-writer", daemon=True)
        self._thread.start()

    def put(self, record) -> None:
        self._errors.check()
        with self._room:
            while self._pending_steps >= self.max_pending_batches * self.controller.batch_steps:
                self._room.wait()
            self._pending_steps += 1
        self._queue.put(record)

    def _release(self, steps: int) -> None:
        with self._room:
            self._pending_steps -= steps
            self._room.notify_all()

    def seal(self) -> threading.Event:
        """Close the current batch (write it even if partial); the event is set when it is durable."""
        done = threading.Event()
        self._queue.put(done)
        return done

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
        pending: list = []
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                self._write(pending)
                pending = []
                item.set()
                continue
            try:
                if self._errors.error is None:
                    pending.append((item.step, encode_record(item)))
            except BaseException as exc:
                self._errors.error = exc
            if len(pending) >= self.controller.batch_steps:
                self._write(pending)
                pending = []
            elif self._errors.error is not None:
                self._release(1)

    def _write(self, pending: list) -> None:
        try:
            if pending and self._errors.error is None:
                started = time.perf_counter()
                first, last = pending[0][0], pending[-1][0]
                path = self.store.batch_path(first, last)
                nbytes = write_batch(path, self.store.session, pending, engine=self._engine)
                self.store.commit_batch(first, last, path, nbytes)
                self.controller.batch_written(len(pending), time.perf_counter() - started)
        except BaseException as exc:
            self._errors.error = exc
        finally:
            self._release(len(pending))


class FullWriter:
    """Persists one full checkpoint at a time from a reused staging snapshot."""

    def __init__(self, store, controller, engine=None):
        self.store = store
        self.controller = controller
        self._engine = engine
        self._snapshot = Snapshot()
        self._thread: threading.Thread | None = None
        self._errors = _ErrorSlot()

    def take(self, step: int, state: dict, meta: dict, base: bool) -> None:
        """Copy ``state`` into staging (blocking: the one memcpy) and persist it in the background.
        Waits first for the previous persist (its staging memory is reused)."""
        self.wait()
        started = time.perf_counter()
        self._snapshot.take(step, state, meta)
        self.controller.full_taken(time.perf_counter() - started)
        self._thread = threading.Thread(target=self._persist, args=(step, base),
                                        name="lowdiff-full-writer", daemon=True)
        self._thread.start()

    def prepare(self, payload_bytes: int) -> None:
        """Pre-fault staging for the next full checkpoint in the background."""
        def run():
            try:
                self._snapshot.prepare(payload_bytes)
            except BaseException as exc:
                self._errors.error = exc
        self.wait()
        self._thread = threading.Thread(target=run, name="lowdiff-staging-prefault", daemon=True)
        self._thread.start()

    def _persist(self, step: int, base: bool) -> None:
        try:
            started = time.perf_counter()
            path = self.store.full_path(step)
            nbytes = self._snapshot.persist(path, self.store.session, engine=self._engine)
            self.store.commit_full(step, path, nbytes, base=base)
            self.controller.full_persisted(time.perf_counter() - started)
        except BaseException as exc:
            self._errors.error = exc

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._errors.check()
