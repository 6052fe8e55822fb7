"""Aligned staging memory and byte views of the objects callers hand us."""
from __future__ import annotations

import ctypes
import mmap
import threading
from typing import TYPE_CHECKING, cast

import numpy as np

from ._config import ALIGN_BYTES

if TYPE_CHECKING:
    from typing import TypeAlias

    import torch
    from typing_extensions import Buffer

    # What byte_view accepts: any C-contiguous buffer, numpy array or CPU tensor (numpy arrays
    # are listed because numpy's stubs declare no buffer protocol before Python 3.12).
    BytesLike: TypeAlias = Buffer | np.ndarray | torch.Tensor


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of a C-contiguous buffer."""
    if view.nbytes == 0:
        return 0
    if view.readonly:
        # ctypes cannot take a readonly buffer; numpy can tell the address of any buffer.
        return np.frombuffer(view, dtype=np.uint8).ctypes.data
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def byte_view(obj: BytesLike) -> memoryview:
    """A flat, C-contiguous uint8 memoryview of bytes-likes, numpy arrays and CPU torch tensors.

    Raises TypeError for non-contiguous data or tensors that are not on the CPU: copying
    those silently would hide a second memcpy.
    """
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise TypeError("numpy array must be C-contiguous to be written without a copy")
        # .data is memoryview(array); numpy's stubs declare no buffer protocol before Python 3.12.
        return obj.reshape(-1).view(np.uint8).data
    module = type(obj).__module__
    if module.startswith("torch"):
        import torch

        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                raise TypeError(f"tensor on {obj.device} must be copied to CPU staging memory first")
            if not obj.is_contiguous():
                raise TypeError("tensor must be contiguous to be written without a copy")
            if obj.numel() == 0:
                return memoryview(bytearray())  # writable, so an empty tensor is a valid read target
            flat = obj.detach().reshape(-1).view(torch.uint8)
            return flat.numpy().data  # memoryview(array), as above
    # torch's tensors returned above (checked by module so that torch is imported only for them);
    # mypy cannot follow that, and anything else that is no buffer makes memoryview raise TypeError.
    view = memoryview(cast("Buffer", obj))
    if not view.c_contiguous:
        raise TypeError("buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class AlignedBuffer:
    """Page-aligned anonymous memory (mmap), exposed as memoryview, numpy array or torch tensor.

    Used as staging memory: callers snapshot state straight into it and fastio writes it from
    there with O_DIRECT, so the snapshot copy and the I/O staging are the same memcpy.
    """

    def __init__(self, nbytes: int, populate: bool = False) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        self.nbytes = nbytes
        # mmap of length 0 is not allowed; round up to whole pages so O_DIRECT tails fit.
        length = max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)
        # MAP_POPULATE faults every page in at once: first-touch page faults otherwise run at
        # ~1 GB/s and would make the first copy into new staging memory 5-10x slower than memcpy.
        flags = mmap.MAP_PRIVATE | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self._map = mmap.mmap(-1, length, flags=flags)
        self._view = memoryview(self._map)
        self.address = buffer_address(self._view)

    @property
    def capacity_bytes(self) -> int:
        return len(self._map)

    def populate(self, start: int = 0, stop: int | None = None) -> bool:
        """Fault in the pages of bytes ``start:stop`` (``start`` page-aligned) with one system call,
        without holding the GIL, so a helper thread can prepare memory ahead of I/O into it.
        False when the kernel cannot (MADV_POPULATE_WRITE is Linux 5.14+): the pages are then
        faulted in by whatever touches them first, as without this call."""
        stop = self.capacity_bytes if stop is None else min(stop, self.capacity_bytes)
        if start % ALIGN_BYTES:
            raise ValueError(f"populate start {start} is not a multiple of {ALIGN_BYTES}")
        if stop <= start:
            return True
        madvise = _libc_madvise()
        return madvise is not None and madvise(self.address + start, stop - start, _MADV_POPULATE_WRITE) == 0

    def view(self, start: int = 0, stop: int | None = None) -> memoryview:
        return self._view[start:self.nbytes if stop is None else stop]

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self._view, dtype=np.uint8, count=self.nbytes)

    def tensor(self, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 tensor over the first ``nbytes`` (default: all requested) bytes."""
        import torch

        count = self.nbytes if nbytes is None else nbytes
        if count > self.capacity_bytes:
            raise ValueError(f"{count} bytes exceed the buffer's {self.capacity_bytes}")
        if not count:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._view, dtype=torch.uint8, count=count)


_MADV_POPULATE_WRITE = 23   # linux/mman.h; Python's mmap module names it only from 3.13 on
_madvise: list = []


def _libc_madvise():
    """libc's madvise through ctypes (which releases the GIL during the call), or None."""
    if not _madvise:
        try:
            function = ctypes.CDLL(None, use_errno=True).madvise
            function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            function.restype = ctypes.c_int
        except (OSError, AttributeError):
            function = None
        _madvise.append(function)
    return _madvise[0]


def aligned_buffer(nbytes: int, populate: bool = False) -> AlignedBuffer:
    """Allocate ``nbytes`` of 4096-aligned staging memory (``populate``: pre-fault its pages)."""
    return AlignedBuffer(nbytes, populate)


class StagingPool:
    """A process-wide free list of pre-faulted staging buffers, so that each new Writer copies into
    memory whose pages already exist instead of paying page faults on every checkpoint."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: list[AlignedBuffer] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> AlignedBuffer:
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.nbytes == nbytes:
                    return self._free.pop(i)
        return AlignedBuffer(nbytes, populate=True)

    def give(self, buffer: AlignedBuffer) -> None:
        """Return a buffer no I/O is using any more."""
        with self._lock:
            if sum(b.capacity_bytes for b in self._free) + buffer.capacity_bytes <= self.max_bytes:
                self._free.append(buffer)


staging_pool = StagingPool()
