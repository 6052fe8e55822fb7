"""The one place that turns an errno from a system call into a Python OSError with context."""
from __future__ import annotations

import os


def io_error(errno_value: int | None, operation: str, path: str, nbytes: int | None = None,
             offset: int | None = None) -> OSError:
    """Build an OSError (its errno-specific subclass) naming the operation, size, offset and path.

    ``errno_value`` must be the error the kernel returned for this call (``cqe.res`` or the
    exception of the failing call), never a stale global errno.
    """
    # Callers pass ``exc.errno`` of an OSError a system call raised: it always carries one.
    assert errno_value is not None, f"{operation} of {path!r} failed without an errno"
    what = operation
    if nbytes is not None:
        what += f" of {nbytes} bytes"
    if offset is not None:
        what += f" at offset {offset}"
    message = f"{what} failed: {os.strerror(errno_value)}"
    # OSError(errno, ...) returns the matching subclass (FileNotFoundError, PermissionError, ...).
    return OSError(errno_value, message, path)
