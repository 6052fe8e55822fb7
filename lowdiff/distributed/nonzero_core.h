/* nonzero_core.h - the positions and bit patterns of the elements of an array that are not all
 * zero bits.
 *
 * Under DDP the gradient the optimizer consumes is the comm hook's sparse aggregate, and a
 * differential records its nonzero elements. Judged by bits, not by value: -0.0 and NaNs are
 * recorded as they are, so the replayed gradient has the same bytes. Most of a top-k aggregate is
 * zero, so the scan tests 32-byte blocks at a time and looks inside only the blocks that hold
 * something; 4-byte elements on a CPU with AVX2 go through a branch-free loop instead (see
 * nonzero_core.c), about 3.5x faster at a top-k aggregate's density. Nothing here takes the GIL
 * or calls into Python; it is safe from any thread.
 */
#ifndef LOWDIFF_NONZERO_CORE_H
#define LOWDIFF_NONZERO_CORE_H

#include <stddef.h>
#include <stdint.h>

/* Scan the `count` elements of `itemsize` bytes (1, 2, 4 or 8) at `src`, in order. For each one
 * whose bytes are not all zero, while fewer than `capacity` were found, store its position in
 * `positions` (int32) and its bytes in `values` (`itemsize` bytes each). Returns how many there
 * are in all, which may exceed `capacity` (then only the first `capacity` were stored); returns
 * -1 for an unsupported itemsize or a count past INT32_MAX. */
int64_t lowdiff_nonzero(const void *src, int64_t count, int itemsize, int32_t *positions, void *values,
                        int64_t capacity);

#endif
