# cython: language_level=3, boundscheck=False, wraparound=False
"""Bulk memory copies that run without the GIL, on the calling thread only.

lowdiff snapshots training state into staging memory from a background thread while the training
thread runs the next forward pass. torch's copy would spread the work over the intra-op thread
pool, which the training thread is using at that moment (oversubscribing the cores), and each
torch call takes the GIL. Here one call copies every region with plain memcpy and holds the GIL
only to read the addresses.
"""
from libc.stdint cimport uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy


def copy_regions(dst_addresses, src_addresses, sizes) -> int:
    """memcpy(dst[i], src[i], sizes[i]) for every i; returns the bytes copied.

    The caller guarantees that every region is valid, writable at ``dst`` and does not overlap,
    for the whole call (it must keep the owning objects alive).
    """
    cdef Py_ssize_t n = len(sizes)
    if len(dst_addresses) != n or len(src_addresses) != n:
        raise ValueError(f"copy_regions: {len(dst_addresses)} destinations, {len(src_addresses)} "
                         f"sources and {n} sizes")
    if n == 0:
        return 0
    cdef uintptr_t* dst = <uintptr_t*>malloc(n * sizeof(uintptr_t))
    cdef uintptr_t* src = <uintptr_t*>malloc(n * sizeof(uintptr_t))
    cdef uint64_t* size = <uint64_t*>malloc(n * sizeof(uint64_t))
    cdef Py_ssize_t i
    cdef uint64_t total = 0
    try:
        if dst == NULL or src == NULL or size == NULL:
            raise MemoryError()
        for i in range(n):
            dst[i] = dst_addresses[i]
            src[i] = src_addresses[i]
            size[i] = sizes[i]
            if size[i] and (dst[i] == 0 or src[i] == 0):
                raise ValueError(f"copy_regions: region {i} has a null address")
            total += size[i]
        with nogil:
            for i in range(n):
                if size[i]:
                    memcpy(<void*>dst[i], <const void*>src[i], size[i])
        return total
    finally:
        free(dst)
        free(src)
        free(size)
