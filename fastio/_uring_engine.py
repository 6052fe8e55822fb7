"""The io_uring backend: one ring and one thread that keeps up to ``queue_depth`` pieces in flight.

The thread takes pieces from the shared queue (blocking only when nothing is in flight),
prepares one SQE per piece, submits and waits for at least one completion with the GIL
released, and handles completions: an error completes the piece's ticket with an ``OSError``
naming the operation, size, offset and path; a short transfer is resubmitted for the remainder;
a read that returns 0 bytes early raises ``EOFError``. The piece objects held while in flight
keep their buffers alive.

``register_buffer`` hands the thread a buffer to register for fixed I/O (the kernel pins its
pages once; requests inside it skip the per-request pinning): the thread first finishes what is
in flight, then registers it (in slices of at most 1 GiB) and keeps the buffer alive until it is
replaced, dropped, or the engine closes.
"""
from __future__ import annotations

import collections
import errno
import itertools
import threading

from ._engine import URGENT, Engine, Piece, Ticket
from ._errors import io_error
from ._uring import Ring

# The kernel registers at most 1 GiB per iovec: a larger buffer (a GPU model's staging) goes as
# several slices; a request that crosses a slice boundary is written the ordinary way.
FIXED_SLICE_BYTES = 1 << 30


class _Registration(Piece):
    """A control item in the piece queue: (un)register ``buffer`` on the engine's thread, the only
    thread that uses the ring."""

    __slots__ = ("buffer", "accepted")

    def __init__(self, buffer) -> None:
        super().__init__("register", -1, None, 0, "", Ticket(1, 0))
        self.buffer = buffer
        self.accepted = False


class UringEngine(Engine):
    name = "uring"

    def __init__(self, config):
        super().__init__(config)
        self._ring = Ring(config.queue_depth)  # OSError here if io_uring cannot be set up
        # The kernel may clamp the ring below queue_depth; the ring also refuses more requests
        # than its CQ holds, so this bound keeps prep() from ever reporting a full ring.
        self._depth = min(config.queue_depth, self._ring.sq_entries)
        self._thread = threading.Thread(target=self._run, name="fastio-uring", daemon=True)
        self._thread.start()

    def register_buffer(self, buffer) -> bool:
        if self._closed:
            return False
        item = _Registration(buffer)
        self._queue.put_many(URGENT, [item])
        while True:
            try:
                item.ticket.wait(0.5)
                return item.accepted
            except OSError:
                return False   # the ring failed: the requests themselves report it
            except TimeoutError:
                # A close() racing this call may have let the thread end before it took the item.
                if not self._thread.is_alive():
                    return False

    def _run(self) -> None:
        inflight: dict[int, object] = {}  # user_data -> Piece
        backlog: collections.deque = collections.deque()  # pieces the ring had no room for
        ids = itertools.count()
        try:
            while True:
                while len(inflight) < self._depth:
                    if backlog:
                        piece = backlog.popleft()
                    else:
                        piece = self._queue.get(block=not inflight)
                        if piece is None:
                            if not inflight:
                                return  # queue closed and drained: the only way out
                            break  # nothing more queued right now: go wait for completions
                    if isinstance(piece, _Registration):
                        self._settle(ids, inflight, backlog)
                        self._register(piece)
                        continue
                    if not self._start(next(ids), piece, inflight):
                        backlog.appendleft(piece)
                        break
                if not inflight:
                    continue
                self._wait_some(inflight, backlog)
        except BaseException as exc:  # the ring failed: no ticket may be left waiting
            self._fail_all(exc, inflight, backlog)
        finally:
            self._ring.close()   # (drops the registration: the kernel lets the pages go)
            self.registered = None

    def _wait_some(self, inflight: dict, backlog) -> None:
        self._ring.submit_and_wait(1)
        for user_data, res in self._ring.reap():
            self._complete(user_data, inflight.pop(user_data), res, inflight, backlog)

    def _settle(self, ids, inflight: dict, backlog) -> None:
        """Finish every request in flight, and the remainders they resubmit, before the
        registration changes: a request must not outlive the registered memory it may use."""
        while inflight or backlog:
            while backlog and len(inflight) < self._depth:
                piece = backlog.popleft()
                if not self._start(next(ids), piece, inflight):
                    backlog.appendleft(piece)
                    break
            if inflight:
                self._wait_some(inflight, backlog)

    def _register(self, item: _Registration) -> None:
        try:
            if item.buffer is None:
                if self.registered is not None:
                    self._ring.unregister_buffers()
                self.registered, item.accepted = None, True
            else:
                # The ring drops the previous table first; the kernel pins the pages it finds now,
                # so the memory must stay mapped while registered: the engine keeps its owner.
                address, nbytes = item.buffer.address, item.buffer.capacity_bytes
                item.accepted = self._ring.register_buffers(
                    [(address + start, min(FIXED_SLICE_BYTES, nbytes - start))
                     for start in range(0, nbytes, FIXED_SLICE_BYTES)])
                self.registered = item.buffer if item.accepted else None
        except OSError as exc:
            self.registered = None
            item.ticket._piece_done(exc)
            return
        item.ticket._piece_done()

    def _start(self, user_data: int, piece, inflight: dict) -> bool:
        """Prepare the rest of ``piece``; False if the ring is full. Bad buffers fail the piece."""
        try:
            queued = self._ring.prep(piece.op, piece.fd, piece.view[piece.done_bytes:],
                                     piece.offset + piece.done_bytes, user_data)
        except (TypeError, ValueError, BufferError, OSError) as exc:
            piece.ticket._piece_done(exc)
            return True
        if queued:
            inflight[user_data] = piece
        return queued

    def _complete(self, user_data: int, piece, res: int, inflight: dict, backlog) -> None:
        rest_bytes = piece.view.nbytes - piece.done_bytes
        offset = piece.offset + piece.done_bytes
        error: Exception | None
        if res == -errno.EINTR:
            error = None  # interrupted before any byte moved: try again
        elif res < 0:
            error = io_error(-res, f"io_uring {piece.op}", piece.path, rest_bytes, offset)
        elif res == 0 and rest_bytes > 0:
            if piece.op == "read":
                error = EOFError(f"read of {rest_bytes} bytes at offset {offset} of {piece.path!r} "
                                 f"reached the end of the file")
            else:
                error = io_error(errno.EIO, "io_uring write (no progress)", piece.path, rest_bytes, offset)
        else:
            error = None
            piece.done_bytes += res
        if error is not None:
            piece.ticket._piece_done(error)
        elif piece.done_bytes < piece.view.nbytes:
            # Short transfer (or EINTR): resubmit the remainder under the same id.
            if not self._start(user_data, piece, inflight):
                backlog.appendleft(piece)
        else:
            piece.ticket._piece_done()

    def _fail_all(self, exc: BaseException, inflight: dict, backlog) -> None:
        """Complete every piece, now and until the queue closes, with the ring's failure."""
        # Wait for the kernel to let go of the buffers before their tickets release them.
        try:
            self._ring.close()
        except OSError:
            pass  # the Ring keeps the buffers it could not wait for alive forever

        def error_for(piece):
            offset = piece.offset + piece.done_bytes
            nbytes = piece.view.nbytes - piece.done_bytes
            if isinstance(exc, OSError) and exc.errno is not None:
                return io_error(exc.errno, f"io_uring {piece.op} (ring failed)", piece.path, nbytes, offset)
            error = RuntimeError(f"io_uring engine failed during {piece.op} of {nbytes} bytes at "
                                 f"offset {offset} of {piece.path!r}: {exc!r}")
            error.__cause__ = exc
            return error

        for piece in list(inflight.values()) + list(backlog):
            piece.ticket._piece_done(error_for(piece))
        inflight.clear()
        backlog.clear()
        while (piece := self._queue.get()) is not None:
            if isinstance(piece, _Registration):
                piece.ticket._piece_done(OSError(f"io_uring engine failed: {exc!r}"))
            else:
                piece.ticket._piece_done(error_for(piece))

    def _join(self) -> None:
        self._thread.join()
