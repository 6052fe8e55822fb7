"""The two pieces lowdiff's background threads are built from: a sticky error slot, re-raised on
the training thread, and a long-lived thread that runs jobs in order."""
from __future__ import annotations

import queue
import threading


class ErrorSlot:
    """The first error of a background thread, kept (sticky) and re-raised with its original type."""

    def __init__(self, durable_step):
        self.error: BaseException | None = None
        self._durable_step = durable_step   # says, in the error, what is still on disk
        self._explained = False

    def check(self) -> None:
        if self.error is None:
            return
        if not self._explained:
            self._explained = True
            self.error.add_note(
                f"lowdiff: checkpointing has stopped; the newest durable step is {max(self._durable_step(), 0)} and "
                f"later steps are not on disk. Fix the cause, then restart from recovery.resume().")
        raise self.error


class Worker:
    """One long-lived daemon thread running jobs in order (a thread per checkpoint would cost the
    training thread a GIL hand-off while it boots)."""

    def __init__(self, name: str):
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._last_done: threading.Event | None = None

    def submit(self, job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        done = threading.Event()
        self._last_done = done
        self._jobs.put((job, done))

    def _run(self) -> None:
        while True:
            job, done = self._jobs.get()
            if job is None:
                return
            try:
                job()  # jobs keep their own errors (see ErrorSlot)
            finally:
                done.set()

    def busy(self) -> bool:
        return self._last_done is not None and not self._last_done.is_set()

    def wait(self) -> None:
        """Until every submitted job has finished."""
        if self._last_done is not None:
            self._last_done.wait()

    def close(self) -> None:
        """Finish the submitted jobs and end the thread (a later submit starts a new one)."""
        if self._thread is not None:
            self._jobs.put((None, None))
            self._thread.join()
            self._thread = None
