/* crc32c_core.h - CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of memory buffers.
 *
 * Convention (the same as zlib.crc32 and the iSCSI/ext4 crc32c): the register is inverted before
 * and after, so crc(empty) == 0, crc("123456789") == 0xE3069283, and passing a previous result as
 * `crc` continues it: crc(b, crc(a, 0)) == crc(a + b, 0).
 *
 * fastio_crc32c_init() builds the tables and picks the backend; call it once before anything
 * else (the Cython module does so at import, under the import lock). After that every function
 * is thread-safe: they only read the tables. Nothing here takes the GIL or calls into Python.
 */
#ifndef FASTIO_CRC32C_CORE_H
#define FASTIO_CRC32C_CORE_H

#include <stddef.h>
#include <stdint.h>

void fastio_crc32c_init(void);

/* The fastest backend available on this CPU. */
uint32_t fastio_crc32c(uint32_t crc, const void *buf, size_t len);

/* memcpy(dst, src, len) and the CRC-32C of those bytes continuing `crc`, in one pass where the CPU
 * folds with AVX-512 (streaming stores to dst), else in cache-sized pieces. The regions must not
 * overlap. */
uint32_t fastio_copy_crc32c(uint32_t crc, void *dst, const void *src, size_t len);

/* The crc32 instruction's path alone (the portable one without SSE4.2), whatever the length: what
 * fastio_crc32c() used before the AVX-512 folding, kept for comparison and tests. */
uint32_t fastio_crc32c_sse42(uint32_t crc, const void *buf, size_t len);

/* Always the portable table (slicing-by-8) path: the reference the hardware path is tested against. */
uint32_t fastio_crc32c_software(uint32_t crc, const void *buf, size_t len);

/* "vpclmulqdq" (long buffers; "sse4.2" below 1 KiB), "sse4.2" or "software": what fastio_crc32c() uses. */
const char *fastio_crc32c_backend(void);

#endif
