"""The one place that turns an errno from a system call into a Python OSError with context."""
import os


def io_error(errno_value: int, operation: str, path: str, nbytes: int | None = None,
             offset: int | None = None) -> OSError:
    """Build an OSError (its errno-specific subclass) naming the operation, size, offset and path.

    ``errno_value`` must be the error the kernel returned for this call (``cqe.res`` or the
    exception of the failing call), never a stale global errno.
    """
    what = operation
    if nbytes is not None:
        what += f" of {nbytes} bytes"
    if offset is not None:
        what += f" at offset {offset}"
    message = f"{what} failed: {os.strerror(errno_value)}"
    # OSError(errno, ...) returns the matching subclass (FileNotFoundError, PermissionError, ...).
    return OSError(errno_value, message, path)
