"""The portable backend: a pool of threads doing os.pwrite/os.preadv (GIL released in the call)."""
from __future__ import annotations

import errno
import os
import threading

from ._engine import Engine
from ._errors import io_error


class PwriteEngine(Engine):
    name = "pwrite"

    def __init__(self, config):
        super().__init__(config)
        self._threads = [threading.Thread(target=self._work, name=f"fastio-pwrite-{i}", daemon=True)
                         for i in range(config.threads)]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            piece = self._queue.get()
            if piece is None:
                return
            try:
                self._transfer(piece)
            except OSError as exc:
                piece.ticket._piece_done(exc)
            except BaseException as exc:  # keep the worker alive; the caller sees the error
                piece.ticket._piece_done(exc)
            else:
                piece.ticket._piece_done()

    @staticmethod
    def _transfer(piece) -> None:
        view, total = piece.view, piece.view.nbytes
        while piece.done_bytes < total:
            offset = piece.offset + piece.done_bytes
            rest = view[piece.done_bytes:]
            try:
                if piece.op == "write":
                    n = os.pwrite(piece.fd, rest, offset)
                else:
                    n = os.preadv(piece.fd, [rest], offset)
            except InterruptedError:
                continue
            except OSError as exc:
                raise io_error(exc.errno, f"pwrite-backend {piece.op}", piece.path, rest.nbytes, offset) from None
            if n == 0:
                if piece.op == "read":
                    raise EOFError(f"read of {rest.nbytes} bytes at offset {offset} of {piece.path!r} "
                                   f"reached the end of the file")
                raise io_error(errno.EIO, "pwrite-backend write (no progress)", piece.path, rest.nbytes, offset)
            piece.done_bytes += n

    def _join(self) -> None:
        for thread in self._threads:
            thread.join()
