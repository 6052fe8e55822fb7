"""Opening files with O_DIRECT where the filesystem allows it, and durable directory updates."""
from __future__ import annotations

import errno
import os

from ._errors import io_error

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def open_file(path: str, flags: int, direct: bool, mode: int = 0o644) -> tuple[int, bool]:
    """Open ``path``; with ``direct`` try O_DIRECT first and fall back to buffered I/O when the
    filesystem refuses it (tmpfs answers EINVAL). Returns (fd, is_direct)."""
    flags |= os.O_CLOEXEC
    if direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, mode), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise io_error(exc.errno, "open", path) from None
            if flags & os.O_CREAT and flags & os.O_EXCL:
                # O_EXCL: the failed attempt may have created the file before refusing O_DIRECT.
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
    try:
        return os.open(path, flags, mode), False
    except OSError as exc:
        raise io_error(exc.errno, "open", path) from None


def fsync_directory(directory: str) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
