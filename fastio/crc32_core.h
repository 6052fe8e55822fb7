/* crc32_core.h - CRC-32 as zlib computes it (reflected polynomial 0xEDB88320) of memory buffers.
 *
 * Bit-identical to zlib.crc32 (same inversion convention: crc(empty) == 0, crc("123456789") ==
 * 0xCBF43926, crc(b, crc(a, 0)) == crc(a + b, 0)); lowdiff's record format fixes this checksum.
 * zlib 1.2.x computes it at about 4 GB/s; the carry-less multiply path here folds 64 bytes per
 * step and runs at memory speed, which matters when a recovery verifies gigabytes of records on
 * the same cores that run the optimizer.
 *
 * fastio_crc32_init() builds the tables and picks the backend; call it once before anything else
 * (the Cython module does so at import). After that every function is thread-safe and nothing
 * here takes the GIL.
 */
#ifndef FASTIO_CRC32_CORE_H
#define FASTIO_CRC32_CORE_H

#include <stddef.h>
#include <stdint.h>

void fastio_crc32_init(void);

/* The fastest backend available on this CPU. */
uint32_t fastio_crc32(uint32_t crc, const void *buf, size_t len);

/* Always the portable table (slicing-by-8) path: the reference the folding path is tested against. */
uint32_t fastio_crc32_software(uint32_t crc, const void *buf, size_t len);

/* crc * x^(8 * nbytes) mod P: what `nbytes` more bytes after data whose CRC is `crc` contribute
 * to the CRC of the whole. CRCs are linear, so (zlib's crc32_combine)
 *     crc(A ++ B) == fastio_crc32_shift(crc(A), |B|) ^ crc(B),
 * which lets a writer insert bytes into a checksummed range without reading the rest again. */
uint32_t fastio_crc32_shift(uint32_t crc, uint64_t nbytes);

/* "pclmul" or "software": what fastio_crc32() uses. */
const char *fastio_crc32_backend(void);

#endif
