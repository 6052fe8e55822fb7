# cython: language_level=3, boundscheck=False, wraparound=False
"""Memory operations without the GIL: bulk copies and CRC-32C checksums.

``copy_regions``: lowdiff snapshots training state into staging memory from a background thread
while the training thread runs the next forward pass. torch's copy would spread the work over the
intra-op thread pool, which the training thread is using at that moment (oversubscribing the
cores), and each torch call takes the GIL. Here one call copies every region with plain memcpy,
and holds the GIL only to read the addresses. With checksums, each region is copied and
checksummed in one pass where the CPU folds CRCs with AVX-512 (streaming stores: about 1.1
memcpys of CPU), else in cache-sized pieces (the checksum reads the copy from cache).

``crc32c``: CRC-32C (Castagnoli) of any C-contiguous buffer, a thin layer over crc32c_core.c. The
hardware paths (AVX-512 carry-less folding, or the SSE4.2 crc32 instruction; chosen at import
from what the CPU supports) run at or above memory speed, far faster than zlib.crc32, so
checksumming a checkpoint costs little next to writing it.

``crc32``: zlib's CRC-32 (which lowdiff's step records use), bit-identical to ``zlib.crc32`` but
folded with carry-less multiplication (crc32_core.c) at memory speed.
"""
from libc.stdint cimport uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from cpython.buffer cimport PyBUF_STRIDED_RO, PyBuffer_IsContiguous, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint32_t

cdef extern from "crc32c_core.h":
    void fastio_crc32c_init()
    uint32_t fastio_crc32c(uint32_t crc, const void *buf, size_t len) nogil
    uint32_t fastio_crc32c_software(uint32_t crc, const void *buf, size_t len) nogil
    uint32_t fastio_crc32c_sse42(uint32_t crc, const void *buf, size_t len) nogil
    uint32_t fastio_copy_crc32c(uint32_t crc, void *dst, const void *src, size_t len) nogil
    const char *fastio_crc32c_backend()

cdef extern from "crc32_core.h":
    void fastio_crc32_init()
    uint32_t fastio_crc32(uint32_t crc, const void *buf, size_t len) nogil
    uint32_t fastio_crc32_software(uint32_t crc, const void *buf, size_t len) nogil
    uint32_t fastio_crc32_shift(uint32_t crc, uint64_t nbytes) nogil
    const char *fastio_crc32_backend()

# Builds the tables once, here: module import is serialized, so no call can see them half-built.
fastio_crc32c_init()
fastio_crc32_init()

ctypedef uint32_t (*checksum_fn)(uint32_t crc, const void *buf, size_t len) noexcept nogil

cdef enum:
    # Below this, releasing and retaking the GIL costs about as much as the checksum itself.
    NOGIL_MIN_BYTES = 64 * 1024


cdef object _checksum(object data, uint32_t value, checksum_fn fn, str name):
    cdef Py_buffer view
    # STRIDED (not SIMPLE) so that a non-contiguous exporter hands over its layout instead of
    # raising BufferError; we reject it below with a clearer message. _RO: readonly is fine.
    PyObject_GetBuffer(data, &view, PyBUF_STRIDED_RO)  # TypeError if data is not a buffer
    try:
        if not PyBuffer_IsContiguous(&view, c'C'):
            raise ValueError(f"{name}: data must be a C-contiguous buffer, got a non-contiguous "
                             f"{type(data).__name__}; pass a contiguous copy (e.g. "
                             f"numpy.ascontiguousarray(data) or bytes(data))")
        if view.len < NOGIL_MIN_BYTES:
            value = fn(value, view.buf, view.len)
        else:
            with nogil:  # the exporter cannot resize or free the memory while we hold the view
                value = fn(value, view.buf, view.len)
    finally:
        PyBuffer_Release(&view)
    return value


def crc32c(data, uint32_t value=0) -> int:
    """CRC-32C of ``data`` (any C-contiguous buffer), continuing from ``value``.

    Same convention as ``zlib.crc32``: ``crc32c(b"") == 0`` and
    ``crc32c(b, crc32c(a)) == crc32c(a + b)``. ``value`` must fit in 32 bits (else OverflowError).
    """
    return _checksum(data, value, fastio_crc32c, "crc32c")


def crc32c_software(data, uint32_t value=0) -> int:
    """``crc32c`` always computed by the portable table path (the reference for tests)."""
    return _checksum(data, value, fastio_crc32c_software, "crc32c_software")


def crc32c_sse42(data, uint32_t value=0) -> int:
    """``crc32c`` by the crc32 instruction alone (the table path where the CPU lacks SSE4.2), at
    every length: the path long buffers took before the AVX-512 folding (tests, benchmarks)."""
    return _checksum(data, value, fastio_crc32c_sse42, "crc32c_sse42")


def crc32c_backend() -> str:
    """"vpclmulqdq" (AVX-512 folding from 1 KiB, the crc32 instruction below), "sse4.2" or
    "software": the path ``crc32c`` takes on this CPU."""
    return fastio_crc32c_backend().decode()


def crc32(data, uint32_t value=0) -> int:
    """zlib's CRC-32 of ``data`` (any C-contiguous buffer), continuing from ``value``: the same
    number as ``zlib.crc32(data, value)``, computed by carry-less multiplication where the CPU
    has it (several times zlib 1.2's speed), and without the GIL for large buffers."""
    return _checksum(data, value, fastio_crc32, "crc32")


def crc32_software(data, uint32_t value=0) -> int:
    """``crc32`` always computed by the portable table path (the reference for tests)."""
    return _checksum(data, value, fastio_crc32_software, "crc32_software")


def crc32_shift(uint32_t value, uint64_t nbytes) -> int:
    """``value`` (a ``crc32``) times x^(8 * nbytes): ``crc32(a + b) == crc32_shift(crc32(a), len(b))
    ^ crc32(b)`` (zlib's crc32_combine), in time logarithmic in ``nbytes``."""
    return fastio_crc32_shift(value, nbytes)


def crc32_backend() -> str:
    """"pclmul" or "software": the path ``crc32`` takes on this CPU."""
    return fastio_crc32_backend().decode()


def crc32c_regions(addresses, sizes) -> list:
    """The CRC-32C of every region ``addresses[i]``, ``sizes[i]`` bytes (as ``crc32c`` of its bytes
    would give), in one call that releases the GIL once: a full checkpoint has hundreds of tensors,
    and a GIL taken back after each one's checksum costs a training thread beside it a hand-off
    each. The caller keeps the memory valid for the whole call."""
    cdef Py_ssize_t n = len(sizes)
    if len(addresses) != n:
        raise ValueError(f"crc32c_regions: {len(addresses)} addresses and {n} sizes")
    if n == 0:
        return []
    cdef uintptr_t* address = <uintptr_t*>malloc(n * sizeof(uintptr_t))
    cdef uint64_t* size = <uint64_t*>malloc(n * sizeof(uint64_t))
    cdef uint32_t* crc = <uint32_t*>malloc(n * sizeof(uint32_t))
    cdef Py_ssize_t i
    try:
        if address == NULL or size == NULL or crc == NULL:
            raise MemoryError()
        for i in range(n):
            address[i] = addresses[i]
            size[i] = sizes[i]
            if size[i] and address[i] == 0:
                raise ValueError(f"crc32c_regions: region {i} has a null address")
        with nogil:
            for i in range(n):
                crc[i] = fastio_crc32c(0, <const void*>address[i], size[i]) if size[i] else 0
        return [crc[i] for i in range(n)]
    finally:
        free(address)
        free(size)
        free(crc)


def copy_regions(dst_addresses, src_addresses, sizes, bint checksums=False):
    """memcpy(dst[i], src[i], sizes[i]) for every i. Returns the bytes copied, or with
    ``checksums`` the CRC-32C of every region (as ``crc32c`` of its bytes would give).

    The caller guarantees that every region is valid, writable at ``dst`` and does not overlap,
    for the whole call (it must keep the owning objects alive).
    """
    cdef Py_ssize_t n = len(sizes)
    if len(dst_addresses) != n or len(src_addresses) != n:
        raise ValueError(f"copy_regions: {len(dst_addresses)} destinations, {len(src_addresses)} "
                         f"sources and {n} sizes")
    if n == 0:
        return [] if checksums else 0
    cdef uintptr_t* dst = <uintptr_t*>malloc(n * sizeof(uintptr_t))
    cdef uintptr_t* src = <uintptr_t*>malloc(n * sizeof(uintptr_t))
    cdef uint64_t* size = <uint64_t*>malloc(n * sizeof(uint64_t))
    cdef uint32_t* crc = <uint32_t*>malloc(n * sizeof(uint32_t))
    cdef Py_ssize_t i
    cdef uint64_t total = 0
    try:
        if dst == NULL or src == NULL or size == NULL or crc == NULL:
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
                if not checksums:
                    if size[i]:
                        memcpy(<void*>dst[i], <const void*>src[i], size[i])
                    continue
                # one pass (AVX-512 folding) or cache-sized pieces: crc32c_core.c
                crc[i] = fastio_copy_crc32c(0, <void*>dst[i], <const void*>src[i], size[i])
        if checksums:
            return [crc[i] for i in range(n)]
        return total
    finally:
        free(dst)
        free(src)
        free(size)
        free(crc)
