"""fastio.Writer: append bytes to a new file at device speed and commit it atomically.

Contract: nothing is visible at ``path`` until the writer commits (clean exit of the ``with``
block or ``commit()``): the data is written, ``fdatasync``ed, the temporary name is
``os.replace``d onto ``path`` and the directory is fsynced. On an exception inside the block, or
``abort()``, the temporary file is removed and an existing ``path`` is untouched.
"""
from __future__ import annotations

import os
import secrets
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Literal

from . import _engine
from ._config import ALIGN_BYTES, FastioConfig
from ._engine import Engine, Ticket
from ._errors import io_error
from ._files import fsync_directory, open_file
from ._memory import buffer_address, byte_view, staging_pool
from ._select import engine as shared_engine

if TYPE_CHECKING:
    from ._memory import BytesLike


class _Slot:
    """One aligned staging buffer and the write that currently reads from it."""

    __slots__ = ("buffer", "array", "ticket")

    def __init__(self, nbytes: int) -> None:
        self.buffer = staging_pool.take(nbytes)
        self.array = self.buffer.numpy()
        self.ticket: Ticket | None = None

    def wait(self) -> None:
        if self.ticket is not None:
            ticket, self.ticket = self.ticket, None
            ticket.wait()


class Writer:
    """Sequential writer of one file. ``write`` returns the file offset of the object written.

    Aligned data written at an aligned offset goes to the kernel straight from the caller's memory
    (no copy; the caller must keep it unchanged until ``commit``); anything else is copied into a
    ring of aligned staging slots whose writes overlap the next copy-in.
    """

    def __init__(self, path: str | os.PathLike[str], config: FastioConfig | None = None, *,
                 size_hint: int | None = None, priority: int = _engine.BULK, engine: Engine | None = None) -> None:
        self.path = os.fspath(path)
        self.config = config or FastioConfig.from_env()
        self._engine = engine or shared_engine()
        self._priority = priority
        directory, name = os.path.split(os.path.abspath(self.path))
        self._directory = directory
        self._tmp_path = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            self._fd, self.direct = open_file(self._tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                              self.config.direct)
        except OSError as exc:  # name the path the caller gave, not our hidden temporary name
            raise io_error(exc.errno, "create", self.path) from None
        self._state = "open"
        self._size = 0          # logical bytes appended so far
        self._flushed = 0       # file offset where the current staging slot starts
        self._fill = 0          # bytes in the current staging slot
        self._slots: list[_Slot] = []
        self._slot_index = 0
        self._tickets: list[Ticket] = []  # zero-copy writes in flight
        self._allocated_bytes = 0  # file length set by size_hint's fallocate
        if size_hint:
            self._preallocate(size_hint)

    # ----------------------------------------------------------------- public API
    @property
    def size(self) -> int:
        """Bytes appended so far (the committed file's length)."""
        return self._size

    def write(self, obj: BytesLike, *, align: int = 1) -> int:
        """Append ``obj`` (bytes-like, numpy array or CPU tensor), first padding with zeros to a
        multiple of ``align``; return the offset where it starts."""
        self._check_open()
        if align > 1 and self._size % align:
            self._append_copy(memoryview(bytes(align - self._size % align)))
        view = byte_view(obj)
        offset = self._size
        if view.nbytes == 0:
            return offset
        direct_bytes = 0
        aligned = self._size % ALIGN_BYTES == 0 and buffer_address(view) % ALIGN_BYTES == 0
        if aligned and self._fill and view.nbytes >= ALIGN_BYTES:
            # The staged bytes end on an aligned offset: write them out so this object goes zero-copy.
            self._submit_current_slot(final=False)
        if aligned and self._fill == 0:
            direct_bytes = view.nbytes - view.nbytes % ALIGN_BYTES
        if direct_bytes:
            self._tickets.append(self._engine.submit_write(
                self._fd, view[:direct_bytes], self._size, self.path, self._priority, keepalive=obj))
            self._size += direct_bytes
            self._flushed += direct_bytes
        if direct_bytes < view.nbytes:
            self._append_copy(view[direct_bytes:])
        return offset

    def pad_to(self, align: int) -> int:
        """Pad with zeros to a multiple of ``align``; return the new size."""
        self._check_open()
        if self._size % align:
            self._append_copy(memoryview(bytes(align - self._size % align)))
        return self._size

    def commit(self, check: Callable[[str], None] | None = None) -> None:
        """Make the file durable under its final name (see the module docstring). Idempotent.
        ``check(temporary_path)`` is called with the data durable under the temporary name, just
        before the rename (e.g. to read it back): if it raises, the file is aborted and nothing
        appears at ``path``."""
        if self._state == "committed":
            return
        self._check_open()
        try:
            padded = self._submit_current_slot(final=True)
            self._wait_all()
            self._release_slots()
            if padded != self._size or self._size == 0 or self._allocated_bytes > self._size:
                os.ftruncate(self._fd, self._size)
            os.fdatasync(self._fd)
            if check is not None:
                check(self._tmp_path)
        except OSError as exc:
            self.abort()
            if exc.filename is None:
                raise io_error(exc.errno, "commit", self.path) from None
            raise
        except BaseException:
            self.abort()
            raise
        os.close(self._fd)
        self._fd = -1
        try:
            os.replace(self._tmp_path, self.path)
            fsync_directory(self._directory)
        except OSError as exc:
            self._state = "aborted"
            _unlink_quietly(self._tmp_path)
            raise io_error(exc.errno, "rename into place", self.path) from None
        self._state = "committed"

    def abort(self) -> None:
        """Drop everything written; ``path`` is left as it was. Idempotent."""
        if self._state in ("aborted", "committed"):
            return
        self._state = "aborted"
        try:
            self._wait_all(raise_errors=False)
            self._release_slots()
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            _unlink_quietly(self._tmp_path)

    close = commit

    def _release_slots(self) -> None:
        """Hand the staging slots back to the pool (every write reading them has completed)."""
        for slot in self._slots:
            staging_pool.give(slot.buffer)
        self._slots = []

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        if exc_type is None:
            if self._state != "aborted":  # abort() inside the block is a decision, not an error
                self.commit()
        else:
            self.abort()
        return False

    def __del__(self) -> None:
        if getattr(self, "_state", None) == "open":
            warnings.warn(f"fastio.Writer for {self.path!r} was neither committed nor aborted; aborting",
                          ResourceWarning, stacklevel=2)
            try:
                self.abort()
            except Exception:
                pass

    # ----------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"fastio.Writer for {self.path!r} is {self._state}")

    def _preallocate(self, nbytes: int) -> None:
        allocated = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        try:
            os.posix_fallocate(self._fd, 0, allocated)
            self._allocated_bytes = allocated
        except OSError as exc:
            if exc.errno in (95, 22):  # EOPNOTSUPP / EINVAL: filesystem cannot; not an error
                return
            self.abort()
            raise io_error(exc.errno, "fallocate", self.path, nbytes, 0) from None

    def _current_slot(self) -> _Slot:
        """The slot being filled; slots are allocated lazily up to ``staging_slots``."""
        if self._slot_index == len(self._slots):
            self._slots.append(_Slot(self.config.staging_slot_bytes))
        slot = self._slots[self._slot_index]
        if self._fill == 0:
            try:
                slot.wait()  # its previous write must finish before we overwrite it
            except BaseException:
                self.abort()  # that write failed: the file has a hole, never commit it
                raise
        return slot

    def _append_copy(self, view: memoryview) -> None:
        import numpy as np

        source = np.frombuffer(view, dtype=np.uint8)
        done = 0
        slot_bytes = self.config.staging_slot_bytes
        while done < source.size:
            slot = self._current_slot()
            n = min(slot_bytes - self._fill, source.size - done)
            slot.array[self._fill:self._fill + n] = source[done:done + n]
            self._fill += n
            done += n
            self._size += n
            if self._fill == slot_bytes:
                self._submit_current_slot(final=False)

    def _submit_current_slot(self, final: bool) -> int:
        """Write the current slot (padded to alignment when final); return the padded file end."""
        if self._fill == 0:
            return self._flushed
        slot = self._slots[self._slot_index]
        nbytes = self._fill
        if final and nbytes % ALIGN_BYTES:
            pad = ALIGN_BYTES - nbytes % ALIGN_BYTES
            slot.array[nbytes:nbytes + pad] = 0
            nbytes += pad
        slot.ticket = self._engine.submit_write(self._fd, slot.buffer.view(0, nbytes), self._flushed,
                                                self.path, self._priority, keepalive=slot.buffer)
        self._flushed += nbytes
        self._fill = 0
        # Round robin; the next slot is allocated on first use (index == len(slots)).
        self._slot_index = (self._slot_index + 1) % self.config.staging_slots
        return self._flushed

    def _wait_all(self, raise_errors: bool = True) -> None:
        first_error = None
        tickets = self._tickets + [slot.ticket for slot in self._slots if slot.ticket is not None]
        self._tickets = []
        for slot in self._slots:
            slot.ticket = None
        for ticket in tickets:
            try:
                ticket.wait()
            except BaseException as exc:
                first_error = first_error or exc
        if first_error is not None and raise_errors:
            raise first_error


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
