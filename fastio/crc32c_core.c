/* crc32c_core.c - CRC-32C: SSE4.2 crc32 instruction (three interleaved streams) or slicing-by-8.
 *
 * Everything below works on the raw CRC register (no inversion); the public functions invert
 * before and after. On the raw register a CRC is linear over GF(2):
 *     raw(r, A || B) = shift(raw(r, A), |B|) ^ raw(0, B)
 * where shift(r, n) = r * x^(8n) mod P is "feed n zero bytes". That identity lets the hardware
 * path checksum three adjacent blocks independently and stitch the results together.
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
#endif
    initialized = 1;
}

uint32_t fastio_crc32c(uint32_t crc, const void *buf, size_t len)
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
    if (use_hw)
        return "sse4.2";
#endif
    return "software";
}
