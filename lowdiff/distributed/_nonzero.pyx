# cython: language_level=3, boundscheck=False, wraparound=False
"""The nonzero elements of a flat CPU array, judged by their bits, in one pass without the GIL (a
thin layer over nonzero_core.c; lowdiff.distributed.nonzero chooses the memory and calls it)."""
from libc.stdint cimport int32_t, int64_t, uintptr_t

cdef extern from "nonzero_core.h":
    int64_t lowdiff_nonzero(const void *src, int64_t count, int itemsize, int32_t *positions, void *values,
                            int64_t capacity) nogil

cdef enum:
    # Below this, releasing and retaking the GIL costs about as much as the scan.
    NOGIL_MIN_ELEMENTS = 16 * 1024


def nonzero_into(uintptr_t src, int64_t count, int itemsize, uintptr_t positions, uintptr_t values,
                 int64_t capacity) -> int:
    """Store the positions (int32) and bytes of the first ``capacity`` elements of the ``count``
    elements of ``itemsize`` bytes at address ``src`` that are not all zero bits; return how many
    there are in all. The caller keeps every region alive and large enough for the call."""
    if count < 0 or capacity < 0:
        raise ValueError(f"nonzero_into: count={count} and capacity={capacity} must be >= 0")
    if count and src == 0 or capacity and (positions == 0 or values == 0):
        raise ValueError("nonzero_into: null address")
    cdef int64_t found
    if count < NOGIL_MIN_ELEMENTS:
        found = lowdiff_nonzero(<const void*>src, count, itemsize, <int32_t*>positions, <void*>values, capacity)
    else:
        with nogil:
            found = lowdiff_nonzero(<const void*>src, count, itemsize, <int32_t*>positions, <void*>values,
                                    capacity)
    if found < 0:
        raise ValueError(f"nonzero_into: itemsize {itemsize} (1, 2, 4 or 8) or count {count} (< 2**31) "
                         f"is not supported")
    return found
