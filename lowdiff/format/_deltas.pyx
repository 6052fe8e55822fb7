# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Index deltas of sparse gradients, the way step records store them (docs/format.md, "records"):
each tensor's sorted indices as differences from the previous one (its first index as it is), 2
bytes each when every difference of that tensor fits, else 4. One pass in C each way instead of
numpy's diff / astype / tobytes (encode) and cumsum / min / astype (decode), several passes and
temporaries per record on the training machine's cores."""
import numpy as np

from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

ctypedef fused index_t:
    int32_t
    int64_t


def flat_positions(const index_t[::1] sparse_indices, const int64_t[::1] counts, const int64_t[::1] offsets,
                   const unsigned char[::1] dense):
    """Where a record's values go in a flat buffer of gradients: gradient t has ``counts[t]``
    values for the slot at ``offsets[t]``, all of it when ``dense[t]``, else at its indices (the
    next ``counts[t]`` of ``sparse_indices``, which the sparse gradients hold back to back). One
    int64 array in one pass without the GIL (lowdiff.step.apply, on replay's decoding threads:
    a numpy call per gradient took the GIL back hundreds of times a record)."""
    cdef Py_ssize_t n = counts.shape[0], t, i, total = 0, used = 0, at = 0, k = 0
    if offsets.shape[0] != n or dense.shape[0] != n:
        raise ValueError("flat_positions: counts, offsets and dense differ in length")
    for t in range(n):
        if counts[t] < 0:
            raise ValueError("flat_positions: a negative count")
        total += counts[t]
        if not dense[t]:
            used += counts[t]
    if used != sparse_indices.shape[0]:
        raise ValueError(f"flat_positions: {sparse_indices.shape[0]} sparse indices for {used} sparse values")
    out = np.empty(total, dtype=np.int64)
    if not total:
        return out
    cdef int64_t[::1] view = out
    cdef int64_t base
    with nogil:
        for t in range(n):
            base = offsets[t]
            if dense[t]:
                for i in range(counts[t]):
                    view[at + i] = base + i
            else:
                for i in range(counts[t]):
                    view[at + i] = base + sparse_indices[k + i]
                k += counts[t]
            at += counts[t]
    return out


cdef bint _store_u16(const int64_t *p, Py_ssize_t count, uint16_t *out) noexcept nogil:
    """Store the deltas as u16 and say whether they all fit. Each delta from its two neighbours
    and the check an OR of what lies above 16 bits (nothing carried between iterations but the
    OR), so the compiler vectorizes the loop."""
    cdef uint64_t above = <uint64_t>p[0] >> 16
    cdef Py_ssize_t i
    out[0] = <uint16_t>p[0]   # host order, as numpy's native uint16 was: little-endian
    for i in range(1, count):
        above |= <uint64_t>(p[i] - p[i - 1]) >> 16
        out[i] = <uint16_t>(p[i] - p[i - 1])
    return above == 0


cdef void _store_u32(const int64_t *p, Py_ssize_t count, unsigned char *out) noexcept nogil:
    cdef uint32_t wide
    cdef Py_ssize_t i
    for i in range(count):
        wide = <uint32_t>(p[i] - (p[i - 1] if i else 0))
        memcpy(out + 4 * i, &wide, 4)   # a u32 piece may follow u16 pieces: 2-aligned only


def encode_deltas(const int64_t[::1] indices, counts) -> tuple:
    """(deltas, widths): the deltas of ``indices`` (``counts[i]`` sorted indices per tensor, back
    to back) as a byte buffer, and each tensor's width in bytes (2 or 4). The indices must be
    sorted and unique within each tensor and below 2**32 (the encoder's callers guarantee it).

    Every tensor is first stored at width 2 (the common case at TopK ratios); one that does not fit
    is stored again at width 4 in the same place (the buffer has room for every tensor at 4). All
    tensors in one pass without the GIL: this runs on the writer thread beside training, and a
    GIL taken back per tensor (hundreds a record) would cost the training thread a hand-off each."""
    cdef Py_ssize_t n = len(counts), t, total = 0
    sizes = np.asarray(counts, dtype=np.int64).reshape(n)
    cdef const int64_t[::1] count_of = sizes
    for t in range(n):
        if count_of[t] < 0 or total + count_of[t] > indices.shape[0]:
            raise ValueError(f"encode_deltas: counts {list(counts)} do not match {indices.shape[0]} indices")
        total += count_of[t]
    wide = np.zeros(n, dtype=np.uint8)
    if not total:
        return bytearray(), [2] * n
    out = np.empty(4 * total, dtype=np.uint8)
    cdef unsigned char[::1] out_view = out
    cdef unsigned char[::1] wide_view = wide
    cdef unsigned char *dst = &out_view[0]
    cdef unsigned char *is_wide = &wide_view[0] if n else NULL
    cdef const int64_t *base = &indices[0]
    cdef Py_ssize_t pos = 0, start = 0, count
    with nogil:
        for t in range(n):
            count = count_of[t]
            if count and not _store_u16(base + start, count, <uint16_t *>(dst + pos)):
                _store_u32(base + start, count, dst + pos)
                is_wide[t] = 1
            pos += count * (4 if is_wide[t] else 2)
            start += count
    return memoryview(out)[:pos], [4 if w else 2 for w in wide.tolist()]


def decode_deltas_many(const unsigned char[::1] data, Py_ssize_t offset, const int64_t[::1] nnzs,
                       const int64_t[::1] widths, const int64_t[::1] numels):
    """The int32 indices of several tensors' deltas lying back to back from ``data[offset:]``
    (tensor t: ``nnzs[t]`` deltas of ``widths[t]`` bytes, restarting from 0), all in one array,
    decoded in one pass without the GIL: ``(indices, -1)``, or ``(None, t)`` for the first tensor
    ``t`` whose deltas do not describe indices sorted, unique and below ``numels[t]``. A record of
    hundreds of tensors decoded one call each took the GIL back hundreds of times, and a decoding
    thread beside one that launches GPU kernels waits for it at each."""
    cdef Py_ssize_t n = nnzs.shape[0], t, total = 0, nbytes = 0, pos, at
    if widths.shape[0] != n or numels.shape[0] != n:
        raise ValueError("decode_deltas_many: nnzs, widths and numels differ in length")
    for t in range(n):
        if widths[t] != 2 and widths[t] != 4:
            raise ValueError(f"decode_deltas_many: width {widths[t]}")
        if nnzs[t] < 0:
            raise ValueError("decode_deltas_many: a negative count")
        total += nnzs[t]
        nbytes += nnzs[t] * widths[t]
    if offset < 0 or offset + nbytes > data.shape[0]:
        raise ValueError("decode_deltas_many: the deltas lie outside the data")
    out = np.empty(total, dtype=np.int32)
    if not total:
        return out, -1
    cdef int32_t[::1] view = out
    cdef const unsigned char *src = &data[0]
    cdef int32_t *dst = &view[0]
    cdef Py_ssize_t bad = -1
    with nogil:
        pos, at = offset, 0
        for t in range(n):
            if nnzs[t] and not _sum_deltas(src + pos, nnzs[t], <int>widths[t], numels[t], dst + at):
                bad = t
                break
            pos += nnzs[t] * widths[t]
            at += nnzs[t]
    return (out, -1) if bad < 0 else (None, bad)


cdef bint _sum_deltas(const unsigned char *src, Py_ssize_t nnz, int width, int64_t numel,
                      int32_t *indices) noexcept nogil:
    """The running sums of the deltas into ``indices``; False at a zero delta after the first
    (a repeated index) or a sum at or past ``numel``."""
    cdef Py_ssize_t i
    cdef int64_t position = 0
    cdef uint16_t narrow = 0
    cdef uint32_t wide = 0
    for i in range(nnz):
        if width == 2:
            memcpy(&narrow, src + 2 * i, 2)
            wide = narrow
        else:
            memcpy(&wide, src + 4 * i, 4)
        if wide == 0 and i > 0:
            return False
        position += wide
        if position >= numel:
            return False
        indices[i] = <int32_t>position
    return True
