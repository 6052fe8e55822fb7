"""fastio.Reader: read byte ranges of a file into caller memory, with O_DIRECT for aligned ranges."""
from __future__ import annotations

import errno
import os
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from . import _engine
from ._config import ALIGN_BYTES, FastioConfig
from ._engine import Engine, Ticket
from ._files import open_file
from ._memory import buffer_address, byte_view
from ._select import engine as shared_engine

if TYPE_CHECKING:
    from ._memory import BytesLike


class Reader:
    """Random-access reader. ``read_into(offset, out)`` fills all of ``out`` or raises.

    Ranges whose offset and target address are 4096-aligned are read with O_DIRECT (the whole
    aligned part; the unaligned tail through the page cache); anything else is read buffered.
    Reading past the end of the file raises ``EOFError`` naming the file and offset.
    """

    def __init__(self, path: str | os.PathLike[str], config: FastioConfig | None = None, *,
                 engine: Engine | None = None) -> None:
        self.path = os.fspath(path)
        self.config = config or FastioConfig.from_env()
        self._engine = engine or shared_engine()
        self._direct_fd = -1
        self._fd, _ = open_file(self.path, os.O_RDONLY, direct=False)
        try:
            self.size = os.fstat(self._fd).st_size
            if self.config.direct:
                self._direct_fd = _reopen_direct(self._fd, self.path)
        except BaseException:
            self.close()   # a constructor that raises leaves nothing open for the garbage collector
            raise

    def read_into(self, offset: int, out: BytesLike, *, priority: int = _engine.BULK) -> None:
        """Fill the writable buffer/array/tensor ``out`` with bytes from ``offset``."""
        self.submit_read_into(offset, out, priority=priority)()

    def submit_read_into(self, offset: int, out: BytesLike, *,
                         priority: int = _engine.BULK) -> Callable[[], None]:
        """Start reading into ``out``; return a function that waits and raises any error."""
        if self._fd < 0:
            raise ValueError(f"fastio.Reader for {self.path!r} is closed")
        view = byte_view(out)
        if view.readonly:
            raise TypeError("read_into needs a writable buffer")
        if offset < 0 or offset + view.nbytes > self.size:
            raise EOFError(f"read of {view.nbytes} bytes at offset {offset} is past the end of "
                           f"{self.path!r} ({self.size} bytes)")
        tickets: list[Ticket] = []
        direct_bytes = 0
        if (self._direct_fd >= 0 and offset % ALIGN_BYTES == 0
                and buffer_address(view) % ALIGN_BYTES == 0):
            direct_bytes = view.nbytes - view.nbytes % ALIGN_BYTES
            if direct_bytes:
                tickets.append(self._engine.submit_read(self._direct_fd, view[:direct_bytes], offset,
                                                        self.path, priority, keepalive=out))
        if direct_bytes < view.nbytes:
            tickets.append(self._engine.submit_read(self._fd, view[direct_bytes:], offset + direct_bytes,
                                                    self.path, priority, keepalive=out))

        def wait() -> None:
            for ticket in tickets:
                ticket.wait()
        return wait

    def read(self, offset: int, nbytes: int) -> bytes:
        """Read ``nbytes`` at ``offset`` as bytes (small, buffered reads: headers, records)."""
        out = bytearray(nbytes)
        self.read_into(offset, out)
        return bytes(out)

    def close(self) -> None:
        """Idempotent."""
        for name in ("_fd", "_direct_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            warnings.warn(f"fastio.Reader for {self.path!r} was not closed", ResourceWarning, stacklevel=2)
            self.close()


def _reopen_direct(fd: int, path: str) -> int:
    """An O_DIRECT descriptor of the file ``fd`` has open, or -1 where the filesystem refuses
    O_DIRECT. It is reopened through /proc/self/fd, not by ``path``: beside a live trainer whose
    retention unlinks (or a commit replaces) ``path`` after ``fd`` was opened, a second open by
    name would fail or, worse, read another file than ``fd``."""
    try:
        direct_fd, is_direct = open_file(f"/proc/self/fd/{fd}", os.O_RDONLY, direct=True)
    except OSError:   # no /proc (or it refuses): by name, and only if it is still the same file
        direct_fd, is_direct = open_file(path, os.O_RDONLY, direct=True)
    same = os.path.samestat(os.fstat(direct_fd), os.fstat(fd))
    if is_direct and same:
        return direct_fd
    os.close(direct_fd)
    if not same:
        raise FileNotFoundError(errno.ENOENT, "the file was replaced while it was opened", path)
    return -1
