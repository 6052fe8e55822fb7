/* crc_reflected.h - what the reflected CRCs in fastio share (CRC-32C in crc32c_core.c, zlib's
 * CRC-32 in crc32_core.c), for a polynomial given as its reflected 32 bits (bit 31 = x^0):
 *
 * - the portable table path, slicing-by-8 on the raw register (no inversion): table[k][b] is the
 *   raw CRC of byte b followed by k zero bytes, so one 8-byte word costs eight independent
 *   lookups instead of eight dependent byte steps;
 * - multiplication mod P and x^(8n) mod P, which shift a CRC past n bytes (CRCs are linear).
 */
#ifndef FASTIO_CRC_REFLECTED_H
#define FASTIO_CRC_REFLECTED_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline uint64_t crc_load_le64(const unsigned char *p)
{
    uint64_t w;
    memcpy(&w, p, 8); /* unaligned-safe; compiles to one load */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

/* The tables of the reflected polynomial `poly` (bit 31 is the x^0 coefficient). */
static inline void crc_slice8_build(uint32_t table[8][256], uint32_t poly)
{
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int i = 0; i < 8; i++)
            c = (c & 1) ? (c >> 1) ^ poly : c >> 1;
        table[0][b] = c;
    }
    for (int k = 1; k < 8; k++)
        for (int b = 0; b < 256; b++)
            table[k][b] = (table[k - 1][b] >> 8) ^ table[0][table[k - 1][b] & 0xff];
}

static inline uint32_t crc_slice8(uint32_t table[8][256], uint32_t crc, const unsigned char *p, size_t len)
{
    while (len && ((uintptr_t)p & 7)) { /* head: bytewise up to an 8-byte boundary */
        crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        len--;
    }
    for (; len >= 8; p += 8, len -= 8) {
        /* The first byte of the word is followed by 7 more, so it takes table 7, and so on. */
        uint64_t w = crc_load_le64(p) ^ crc;
        crc = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^
              table[5][(w >> 16) & 0xff] ^ table[4][(w >> 24) & 0xff] ^
              table[3][(w >> 32) & 0xff] ^ table[2][(w >> 40) & 0xff] ^
              table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
    }
    while (len--)
        crc = table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

/* a * b mod P, both reflected. */
static inline uint32_t crc_mulmod(uint32_t a, uint32_t b, uint32_t poly)
{
    uint32_t product = 0;
    for (int i = 0; i < 32; i++) {
        if (a & (0x80000000u >> i)) /* a has the term x^i, and b is b_original * x^i by now */
            product ^= b;
        b = (b & 1) ? (b >> 1) ^ poly : b >> 1; /* b *= x: x^31 wraps around to x^32 = P */
    }
    return product;
}

/* x^(8 * nbytes) mod P by square-and-multiply. */
static inline uint32_t crc_x_pow_bytes(uint64_t nbytes, uint32_t poly)
{
    uint32_t result = 0x80000000u; /* x^0 */
    uint32_t power = 0x00800000u;  /* x^8: one byte */
    for (; nbytes; nbytes >>= 1) {
        if (nbytes & 1)
            result = crc_mulmod(result, power, poly);
        power = crc_mulmod(power, power, poly);
    }
    return result;
}

#endif
