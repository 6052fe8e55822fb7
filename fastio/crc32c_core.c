/* crc32c_core.c - CRC-32C: AVX-512 carry-less folding (VPCLMULQDQ) for long buffers, the SSE4.2
 * crc32 instruction (three interleaved streams), or slicing-by-8.
 *
 * Everything below works on the raw CRC register (no inversion); the public functions invert
 * before and after. On the raw register a CRC is linear over GF(2):
 *     raw(r, A || B) = shift(raw(r, A), |B|) ^ raw(0, B)
 * where shift(r, n) = r * x^(8n) mod P is "feed n zero bytes". That identity lets the hardware
 * path checksum three adjacent blocks independently and stitch the results together.
 *
 * Why a third path: the crc32 instruction retires 8 bytes a cycle at best, below what one core
 * copies, so a copy fused with its checksum (fastio.copy_regions) ran at ~0.6x memcpy speed. Carry-
 * less folding of 256 bytes a step over four 512-bit accumulators runs well above memory speed
 * where the CPU has VPCLMULQDQ on 512-bit registers (AMD Zen 4+, Intel Ice Lake+). The folding
 * follows crc32_core.c (Gopal et al.), in the bit-reflected domain: an accumulator A standing D
 * bytes before block B becomes A.lo * x^(8D+32) ^ A.hi * x^(8D-32) ^ B (mod P, constants
 * reflected and shifted left by one), which keeps the remainder. The last 128 bits are finished
 * by the crc32 instruction itself: the folded value, read as 16 bytes of message from a zero
 * register, has the CRC of everything folded into it.
 */
#include "crc32c_core.h"
#include "crc_reflected.h"

#define POLY 0x82F63B78u /* Castagnoli, reflected: bit 31 is the x^0 coefficient */

/* sw_table[k][b]: raw CRC of byte b followed by k zero bytes (slicing-by-8). */
static uint32_t sw_table[8][256];

static int initialized;

static uint32_t sw_raw(uint32_t crc, const unsigned char *p, size_t len)
{
    return crc_slice8(sw_table, crc, p, len);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_SSE42_PATH 1
#include <nmmintrin.h>

/* Block lengths (bytes per stream) of the 3-way loop: LONG for bulk data, SHORT for what is left.
 * Each block costs two shifts (8 table lookups); 8 KiB keeps that overhead negligible while the
 * three streams still hide the instruction's 3-cycle latency. */
#define LONG_LEN 8192
#define SHORT_LEN 256

/* shift_*[k][b] = (b << 8k) * x^(8 * LEN) mod P: shift() split into four byte-indexed tables. */
static uint32_t shift_long[4][256], shift_short[4][256];
static int use_hw;

static inline uint32_t shift(uint32_t table[4][256], uint32_t crc)
{
    return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^
           table[2][(crc >> 16) & 0xff] ^ table[3][crc >> 24];
}

/* Whole 3*len-byte blocks of [*pp, *pp + *plen) as three streams; advances *pp and *plen. */
__attribute__((target("sse4.2")))
static inline uint64_t hw_3way(uint64_t c0, const unsigned char **pp, size_t *plen, size_t len,
                               uint32_t table[4][256])
{
    const unsigned char *p = *pp;
    size_t left = *plen;
    for (; left >= 3 * len; left -= 3 * len) {
        uint64_t c1 = 0, c2 = 0; /* the later blocks start from 0 and are shifted in below */
        const unsigned char *end = p + len;
        do {
            c0 = _mm_crc32_u64(c0, crc_load_le64(p));
            c1 = _mm_crc32_u64(c1, crc_load_le64(p + len));
            c2 = _mm_crc32_u64(c2, crc_load_le64(p + 2 * len));
            p += 8;
        } while (p < end);
        c0 = shift(table, (uint32_t)c0) ^ c1;
        c0 = shift(table, (uint32_t)c0) ^ c2;
        p += 2 * len;
    }
    *pp = p;
    *plen = left;
    return c0;
}

__attribute__((target("sse4.2")))
static uint32_t hw_raw(uint32_t crc, const unsigned char *p, size_t len)
{
    uint64_t c = crc;
    while (len && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        len--;
    }
    c = hw_3way(c, &p, &len, LONG_LEN, shift_long);
    c = hw_3way(c, &p, &len, SHORT_LEN, shift_short);
    for (; len >= 8; p += 8, len -= 8)
        c = _mm_crc32_u64(c, crc_load_le64(p));
    while (len--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return (uint32_t)c;
}

#include <immintrin.h>
#define VPCLMUL_MIN 1024 /* below this the setup costs more than the crc32 instruction's loop */

/* Per 128-bit lane (low 64 bits, high 64 bits) = x^(8D+32), x^(8D-32) mod P, reflected, shifted
 * left by one, for a fold across D bytes (derived in tests/unit/test_crc32c.py). */
static const uint64_t FOLD_256[2] = {0x0dcb17aa4ull, 0x0b9e02b86ull};
static const uint64_t FOLD_64[2] = {0x0740eef02ull, 0x09e4addf8ull};
static const uint64_t FOLD_48[2] = {0x01c291d04ull, 0x1d82c63daull};
static const uint64_t FOLD_32[2] = {0x1384aa63aull, 0x0ba4fc28eull};
static const uint64_t FOLD_16[2] = {0x0f20c0dfeull, 0x14cd00bd6ull};
static int use_vpclmul;

#define VPCLMUL_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))

VPCLMUL_TARGET static inline __m512i fold512(__m512i acc, __m512i k, __m512i next)
{
    __m512i lo = _mm512_clmulepi64_epi128(acc, k, 0x00);
    __m512i hi = _mm512_clmulepi64_epi128(acc, k, 0x11);
    return _mm512_ternarylogic_epi64(lo, hi, next, 0x96); /* lo ^ hi ^ next */
}

VPCLMUL_TARGET static inline __m128i fold128(__m128i acc, const uint64_t k[2])
{
    __m128i kk = _mm_loadu_si128((const __m128i *)k);
    return _mm_xor_si128(_mm_clmulepi64_si128(acc, kk, 0x00), _mm_clmulepi64_si128(acc, kk, 0x11));
}

/* The four 128-bit lanes of `a` folded into the last one (48, 32 and 16 bytes before it). */
VPCLMUL_TARGET static inline __m128i lanes_to_128(__m512i a)
{
    __m128i r = _mm512_extracti32x4_epi32(a, 3);
    r = _mm_xor_si128(r, fold128(_mm512_extracti32x4_epi32(a, 0), FOLD_48));
    r = _mm_xor_si128(r, fold128(_mm512_extracti32x4_epi32(a, 1), FOLD_32));
    return _mm_xor_si128(r, fold128(_mm512_extracti32x4_epi32(a, 2), FOLD_16));
}

/* The raw CRC of everything folded into `r`: its 16 bytes through the crc32 instruction from 0. */
VPCLMUL_TARGET static inline uint32_t finish128(__m128i r)
{
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(r));
    return (uint32_t)_mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(r, 1));
}

/* Raw register over the whole 16-byte blocks of [p, p + len), len >= 256; returns the register
 * and leaves the < 16 bytes that remain to the caller (*done = bytes consumed). */
VPCLMUL_TARGET static uint32_t vpclmul_raw(uint32_t crc, const unsigned char *p, size_t len, size_t *done)
{
    const unsigned char *start = p;
    const __m512i k256 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)FOLD_256));
    __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)crc)));
    __m512i a1 = _mm512_loadu_si512(p + 64);
    __m512i a2 = _mm512_loadu_si512(p + 128);
    __m512i a3 = _mm512_loadu_si512(p + 192);
    p += 256;
    len -= 256;
    for (; len >= 256; p += 256, len -= 256) {
        a0 = fold512(a0, k256, _mm512_loadu_si512(p));
        a1 = fold512(a1, k256, _mm512_loadu_si512(p + 64));
        a2 = fold512(a2, k256, _mm512_loadu_si512(p + 128));
        a3 = fold512(a3, k256, _mm512_loadu_si512(p + 192));
    }
    /* Four accumulators into one (each 64 bytes before the next), then whole 64-byte blocks. */
    const __m512i k64 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)FOLD_64));
    __m512i a = fold512(a0, k64, a1);
    a = fold512(a, k64, a2);
    a = fold512(a, k64, a3);
    for (; len >= 64; p += 64, len -= 64)
        a = fold512(a, k64, _mm512_loadu_si512(p));
    /* The four lanes into one, then 16-byte blocks. */
    __m128i r = lanes_to_128(a);
    for (; len >= 16; p += 16, len -= 16)
        r = _mm_xor_si128(fold128(r, FOLD_16), _mm_loadu_si128((const __m128i *)p));
    *done = (size_t)(p - start);
    return finish128(r);
}

/* vpclmul_raw that also copies: every 64 bytes it loads for the checksum are stored at dst too,
 * with non-temporal (streaming) stores in the 256-byte loop (dst 64-byte aligned): one pass over
 * memory, no read-for-ownership of dst, and the copy does not evict the cache lines training is
 * using (nothing on this CPU reads the staging copy again: the disk's DMA does). The stores are
 * fenced before returning. */
VPCLMUL_TARGET static uint32_t vpclmul_copy_raw(uint32_t crc, unsigned char *dst, const unsigned char *p,
                                                size_t len, size_t *done)
{
    const unsigned char *start = p;
    const __m512i k256 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)FOLD_256));
    __m512i b0 = _mm512_loadu_si512(p), b1 = _mm512_loadu_si512(p + 64);
    __m512i b2 = _mm512_loadu_si512(p + 128), b3 = _mm512_loadu_si512(p + 192);
    _mm512_stream_si512((void *)dst, b0);
    _mm512_stream_si512((void *)(dst + 64), b1);
    _mm512_stream_si512((void *)(dst + 128), b2);
    _mm512_stream_si512((void *)(dst + 192), b3);
    __m512i a0 = _mm512_xor_si512(b0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)crc)));
    __m512i a1 = b1, a2 = b2, a3 = b3;
    p += 256;
    dst += 256;
    len -= 256;
    for (; len >= 256; p += 256, dst += 256, len -= 256) {
        b0 = _mm512_loadu_si512(p);
        b1 = _mm512_loadu_si512(p + 64);
        b2 = _mm512_loadu_si512(p + 128);
        b3 = _mm512_loadu_si512(p + 192);
        _mm512_stream_si512((void *)dst, b0);
        _mm512_stream_si512((void *)(dst + 64), b1);
        _mm512_stream_si512((void *)(dst + 128), b2);
        _mm512_stream_si512((void *)(dst + 192), b3);
        a0 = fold512(a0, k256, b0);
        a1 = fold512(a1, k256, b1);
        a2 = fold512(a2, k256, b2);
        a3 = fold512(a3, k256, b3);
    }
    const __m512i k64 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)FOLD_64));
    __m512i a = fold512(a0, k64, a1);
    a = fold512(a, k64, a2);
    a = fold512(a, k64, a3);
    for (; len >= 64; p += 64, dst += 64, len -= 64) {
        b0 = _mm512_loadu_si512(p);
        _mm512_storeu_si512((void *)dst, b0);
        a = fold512(a, k64, b0);
    }
    __m128i r = lanes_to_128(a);
    for (; len >= 16; p += 16, dst += 16, len -= 16) {
        __m128i block = _mm_loadu_si128((const __m128i *)p);
        _mm_storeu_si128((__m128i *)dst, block);
        r = _mm_xor_si128(fold128(r, FOLD_16), block);
    }
    _mm_sfence();
    *done = (size_t)(p - start);
    return finish128(r);
}

static void build_shift_table(uint32_t table[4][256], size_t nbytes)
{
    uint32_t x = crc_x_pow_bytes(nbytes, POLY);
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++)
            table[k][b] = crc_mulmod(b << (8 * k), x, POLY);
}
#endif /* HAVE_SSE42_PATH */

void fastio_crc32c_init(void)
{
    if (initialized)
        return;
    crc_slice8_build(sw_table, POLY);
#ifdef HAVE_SSE42_PATH
    build_shift_table(shift_long, LONG_LEN);
    build_shift_table(shift_short, SHORT_LEN);
    __builtin_cpu_init();
    use_hw = __builtin_cpu_supports("sse4.2") != 0;
    use_vpclmul = use_hw && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                  __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul");
#endif
    initialized = 1;
}

uint32_t fastio_crc32c(uint32_t crc, const void *buf, size_t len)
{
#ifdef HAVE_SSE42_PATH
    const unsigned char *p = buf;
    uint32_t raw = ~crc;
    if (use_vpclmul && len >= VPCLMUL_MIN) {
        size_t done;
        raw = vpclmul_raw(raw, p, len, &done);
        p += done;
        len -= done;
    }
    if (use_hw)
        return ~hw_raw(raw, p, len);
    return ~sw_raw(raw, p, len);
#else
    return ~sw_raw(~crc, (const unsigned char *)buf, len);
#endif
}

/* Copy and checksum in pieces that stay in L2 cache (paths without the folding): the checksum then
 * reads the copy from cache instead of making a second pass over memory. */
#define COPY_CHUNK_BYTES (256 * 1024)

uint32_t fastio_copy_crc32c(uint32_t crc, void *dst, const void *src, size_t len)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
#ifdef HAVE_SSE42_PATH
    if (use_vpclmul && len >= VPCLMUL_MIN + 64) {
        size_t head = (64 - ((uintptr_t)d & 63)) & 63; /* bytes until dst is 64-byte aligned */
        memcpy(d, s, head);
        uint32_t raw = hw_raw(~crc, s, head);
        size_t done;
        raw = vpclmul_copy_raw(raw, d + head, s + head, len - head, &done);
        size_t at = head + done;
        memcpy(d + at, s + at, len - at);
        return ~hw_raw(raw, s + at, len - at);
    }
#endif
    for (size_t at = 0; at < len; at += COPY_CHUNK_BYTES) {
        size_t piece = len - at < COPY_CHUNK_BYTES ? len - at : COPY_CHUNK_BYTES;
        memcpy(d + at, s + at, piece);
        crc = fastio_crc32c(crc, d + at, piece);
    }
    return crc;
}

uint32_t fastio_crc32c_sse42(uint32_t crc, const void *buf, size_t len)
{
#ifdef HAVE_SSE42_PATH
    if (use_hw)
        return ~hw_raw(~crc, (const unsigned char *)buf, len);
#endif
    return ~sw_raw(~crc, (const unsigned char *)buf, len);
}

uint32_t fastio_crc32c_software(uint32_t crc, const void *buf, size_t len)
{
    return ~sw_raw(~crc, (const unsigned char *)buf, len);
}

const char *fastio_crc32c_backend(void)
{
#ifdef HAVE_SSE42_PATH
    if (use_vpclmul)
        return "vpclmulqdq";
    if (use_hw)
        return "sse4.2";
#endif
    return "software";
}
