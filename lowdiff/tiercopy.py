"""One file's copy from the local tier to the shared tier, in the two halves the drainer
(lowdiff.drainer) runs on two threads: ``stage_copy`` writes the copy and makes it durable under a
temporary name; ``publish`` reads it back, compares it with what was read from the local file and
only then renames it into place. Nothing appears under the final name before both are done.
"""
from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

import fastio

from . import faults
from .errors import CorruptCheckpointError

_CHUNK_BYTES = 8 << 20


@dataclasses.dataclass
class Staged:
    """A copy durable under its temporary name beside ``target``, neither verified nor renamed.
    Its owner ``publish``es or ``abort``s it; a crash leaves a dead writer's temporary file, which
    the shared tier's store removes when it is next opened."""

    writer: fastio.Writer
    target: str
    nbytes: int
    crc: int           # CRC-32C of the bytes read from the source (0 when not verifying)
    copy_s: float      # reading the source, writing and syncing the copy

    def abort(self) -> None:
        self.writer.abort()


def stage_copy(source: str, target: str, engine=None, verify: bool = True) -> Staged:
    """Copy ``source`` to a temporary file beside ``target`` with fastio.Writer and make it
    durable there (``Writer.sync``: written, fdatasynced, staging memory released); with ``verify``
    also take the CRC-32C of the bytes read from ``source``. Nothing appears at ``target``."""
    # One reused read buffer, deliberately one byte past a page boundary: fastio writes aligned
    # memory without copying and needs it unchanged until the writes complete, so an aligned
    # buffer could not be refilled; a misaligned one is copied into fastio's staging ring.
    raw = np.empty(_CHUNK_BYTES + 2 * fastio.ALIGN_BYTES, np.uint8)
    start = (-raw.ctypes.data) % fastio.ALIGN_BYTES + 1
    buffer = raw[start:start + _CHUNK_BYTES]
    view = buffer.data
    crc = 0
    started = time.perf_counter()
    with open(source, "rb", buffering=0) as f:
        writer = fastio.Writer(target, size_hint=os.fstat(f.fileno()).st_size, engine=engine)
        try:
            while n := f.readinto(view):
                if verify:
                    crc = fastio.crc32c(buffer[:n], crc)
                writer.write(buffer[:n])
            writer.sync()
        except BaseException:
            writer.abort()
            raise
    staged = Staged(writer, target, writer.size, crc, time.perf_counter() - started)
    faults.point("drain-write")
    return staged


def publish(staged: Staged, engine=None, verify: bool = True) -> float:
    """Commit ``staged`` under its target name (rename, directory fsync), with ``verify`` after
    reading it back (``check_copy``); return the seconds the read-back took. A mismatch raises
    CorruptCheckpointError naming the target, and the temporary file is removed."""
    verify_s = 0.0

    def check(path: str) -> None:
        nonlocal verify_s
        if verify:
            started = time.perf_counter()
            check_copy(path, staged.target, staged.nbytes, staged.crc, engine)
            verify_s = time.perf_counter() - started
        faults.point("drain-verify")

    staged.writer.commit(check=check)
    return verify_s


def check_copy(path: str, target: str, nbytes: int, crc: int, engine=None) -> None:
    """Read ``path`` (the copy of ``target`` before its rename) back and compare its size and CRC-32C
    with what was written. Aligned reads into an aligned buffer go through O_DIRECT where the
    filesystem allows it, so the bytes come from the device rather than from the page cache."""
    chunk = fastio.aligned_buffer(_CHUNK_BYTES)
    found = 0
    with fastio.Reader(path, engine=engine) as reader:
        if reader.size != nbytes:
            raise CorruptCheckpointError(target, f"the copy in the shared tier is {reader.size} bytes, "
                                                 f"{nbytes} were written")
        for offset in range(0, nbytes, _CHUNK_BYTES):
            n = min(_CHUNK_BYTES, nbytes - offset)
            reader.read_into(offset, chunk.view(0, n))
            found = fastio.crc32c(chunk.view(0, n), found)
    if found != crc:
        raise CorruptCheckpointError(target, f"the copy in the shared tier reads back with CRC-32C {found:#010x}, "
                                             f"the bytes written have {crc:#010x}")
