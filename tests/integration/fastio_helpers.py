"""Helpers for the fastio integration tests (not a test module)."""
from __future__ import annotations

import os

import numpy as np

import fastio
from fastio._memory import buffer_address


class SpyEngine:
    """Wraps an engine and records every submitted write as (address, nbytes, file offset)."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.config = inner.config
        self.writes: list[tuple[int, int, int]] = []

    def submit_write(self, fd, view, offset, path, priority=fastio.BULK, keepalive=None):
        self.writes.append((buffer_address(view), view.nbytes, offset))
        return self.inner.submit_write(fd, view, offset, path, priority, keepalive)

    def submit_read(self, fd, view, offset, path, priority=fastio.BULK, keepalive=None):
        return self.inner.submit_read(fd, view, offset, path, priority, keepalive)

    def submitted_from(self, address: int, nbytes: int) -> bool:
        """True if some write was submitted straight from memory in [address, address + nbytes)."""
        return any(address <= start < address + nbytes for start, _, _ in self.writes)


def random_bytes(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(nbytes), dtype=np.uint8).copy() if nbytes else np.zeros(0, np.uint8)


def aligned_copy(data: np.ndarray) -> fastio.AlignedBuffer:
    """``data`` in page-aligned memory (the zero-copy source)."""
    buffer = fastio.aligned_buffer(data.nbytes)
    buffer.numpy()[:] = data
    return buffer


def unaligned_copy(data: np.ndarray) -> np.ndarray:
    """``data`` in memory that starts 1 byte past a page boundary, so it must be staged."""
    backing = np.empty(data.nbytes + fastio.ALIGN_BYTES + 1, dtype=np.uint8)
    start = (-backing.ctypes.data) % fastio.ALIGN_BYTES + 1
    out = backing[start:start + data.nbytes]
    out[:] = data
    assert out.nbytes == 0 or out.ctypes.data % fastio.ALIGN_BYTES == 1
    return out


def read_back(path, engine, *, aligned_target: bool) -> np.ndarray:
    """The whole file through fastio.Reader, into aligned (O_DIRECT) or ordinary memory."""
    with fastio.Reader(path, engine=engine) as reader:
        if aligned_target:
            buffer = fastio.aligned_buffer(reader.size)
            reader.read_into(0, buffer.numpy())
            return buffer.numpy()
        out = np.empty(reader.size, dtype=np.uint8)
        reader.read_into(0, out)
        return out


def listing(directory) -> list[str]:
    return sorted(os.listdir(directory))


def temp_files(directory) -> list[str]:
    return [name for name in os.listdir(directory) if ".tmp-" in name]
