"""The engine interface shared by the io_uring and pwrite backends, and the process-wide engine.

Call order: ``submit_write``/``submit_read`` return a :class:`Ticket` at once; the engine splits
the request into ``chunk_bytes`` pieces, keeps many in flight, resubmits short transfers for the
remainder, and completes the ticket when every byte is transferred or the first error occurred.
``Ticket.wait()`` re-raises that error (an ``OSError`` naming operation, size, offset and path)
in the caller's thread. The caller keeps the buffer alive and unchanged until the ticket is done.

Two priorities share the engine: ``URGENT`` pieces (small, latency-sensitive differential
batches) are always taken before ``BULK`` pieces (full checkpoints).
"""
from __future__ import annotations

import heapq
import itertools
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._config import FastioConfig

URGENT = 0
BULK = 1


class Ticket:
    """Completion handle of one submitted request (``wait()``/``done()``)."""

    __slots__ = ("_pending", "_error", "_event", "_lock", "nbytes", "keepalive")

    def __init__(self, pieces: int, nbytes: int, keepalive: object = None) -> None:
        self._pending = pieces
        self._error: BaseException | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.nbytes = nbytes
        self.keepalive = keepalive  # the buffer's owner, held until completion
        if pieces == 0:
            self._event.set()

    def _piece_done(self, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._pending -= 1
            finished = self._pending == 0
        if finished:
            self.keepalive = None
            self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError("I/O request did not complete in time")
        if self._error is not None:
            raise self._error


class Piece:
    """One chunk of a request: transfer ``view`` to/from ``fd`` at ``offset``."""

    __slots__ = ("op", "fd", "view", "offset", "path", "ticket", "done_bytes")

    def __init__(self, op, fd, view, offset, path, ticket):
        self.op = op  # "write" or "read"
        self.fd = fd
        self.view = view
        self.offset = offset
        self.path = path
        self.ticket = ticket
        self.done_bytes = 0


class PieceQueue:
    """A blocking priority queue of pieces: lower priority value first, FIFO within a priority."""

    def __init__(self):
        self._heap: list = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False

    def put_many(self, priority: int, pieces) -> None:
        with self._cond:
            for piece in pieces:
                heapq.heappush(self._heap, (priority, next(self._seq), piece))
            self._cond.notify_all()

    def get(self, block: bool = True):
        """Next piece; None when closed (blocking) or empty (non-blocking)."""
        with self._cond:
            while block and not self._heap and not self._closed:
                self._cond.wait()
            if self._heap:
                return heapq.heappop(self._heap)[2]
            return None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Engine:
    """Base class: chunking, tickets and the piece queue. Subclasses move the bytes."""

    name = "base"

    def __init__(self, config: FastioConfig) -> None:
        self.config = config
        self._queue = PieceQueue()
        self._closed = False

    def submit_write(self, fd: int, view: memoryview, offset: int, path: str,
                     priority: int = BULK, keepalive: object = None) -> Ticket:
        return self._submit("write", fd, view, offset, path, priority, keepalive)

    def submit_read(self, fd: int, view: memoryview, offset: int, path: str,
                    priority: int = BULK, keepalive: object = None) -> Ticket:
        if view.readonly:
            raise TypeError("read target must be a writable buffer")
        return self._submit("read", fd, view, offset, path, priority, keepalive)

    def _submit(self, op, fd, view, offset, path, priority, keepalive) -> Ticket:
        if self._closed:
            raise ValueError("I/O engine is closed")
        chunk = self.config.chunk_bytes
        starts = range(0, view.nbytes, chunk)
        ticket = Ticket(len(starts), view.nbytes, keepalive if keepalive is not None else view)
        self._queue.put_many(priority, [
            Piece(op, fd, view[start:start + chunk], offset + start, path, ticket) for start in starts])
        return ticket

    # The buffer registered for fixed I/O (None: none). Backends without fixed I/O never set it.
    registered: object = None

    def register_buffer(self, buffer) -> bool:
        """Register ``buffer`` (an ``AlignedBuffer``, or None to drop the registration) so that
        writes and reads inside it skip the kernel's per-request pinning of its pages; it replaces
        the previous registration (one at a time). The engine keeps ``buffer`` alive while it is
        registered. False where the backend or the kernel has no fixed I/O: requests then work
        as before. An optimization only: the bytes moved are the same either way."""
        return False

    def close(self) -> None:
        """Stop the workers after the queued pieces are done. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.close()
        self._join()

    def _join(self) -> None:  # pragma: no cover - overridden
        pass
