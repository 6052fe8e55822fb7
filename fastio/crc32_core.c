/* crc32_core.c - zlib's CRC-32 by carry-less multiplication (PCLMULQDQ), or slicing-by-8.
 *
 * The folding path follows Gopal et al., "Fast CRC Computation for Generic Polynomials Using
 * PCLMULQDQ Instruction" (Intel, 2009), in the bit-reflected domain. Four 128-bit accumulators
 * each absorb every fourth 16-byte block: an accumulator A standing 64 bytes before the next
 * block B becomes  A.lo * K1 ^ A.hi * K2 ^ B,  where K1, K2 are x^(512+32) and x^(512-32) mod P
 * (reflected, shifted left by one). That keeps the remainder mod P unchanged while the four
 * multiplications of a step are independent, hiding the instruction's latency. At the end the
 * four fold into one (x^(128±32) constants), 128 bits reduce to 64 (x^64), and a Barrett
 * reduction by mu = x^64 div P gives the 32-bit remainder. The constants are derived and checked
 * in tests/unit/test_fastio_crc32.py; a different constant cannot pass the comparison with zlib.
 */
#include "crc32_core.h"
#include "crc_reflected.h"

#define POLY 0xEDB88320u /* zlib's polynomial 0x04C11DB7, reflected */

static uint32_t sw_table[8][256];
static int initialized;
static int use_clmul;

static uint32_t sw_raw(uint32_t crc, const unsigned char *p, size_t len)
{
    return crc_slice8(sw_table, crc, p, len);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_CLMUL_PATH 1
#include <immintrin.h>

/* Pairs (low lane, high lane) as _mm_clmulepi64_si128 selects them: imm 0x00 multiplies the low
 * halves, 0x11 the high halves, 0x10 the first operand's low half by the second's high half. */
static const uint64_t K1_K2[2] __attribute__((aligned(16))) = {0x154442bd4ull, 0x1c6e41596ull};
static const uint64_t K3_K4[2] __attribute__((aligned(16))) = {0x1751997d0ull, 0x0ccaa009eull};
static const uint64_t K5_0[2] __attribute__((aligned(16))) = {0x163cd6124ull, 0};
static const uint64_t P_MU[2] __attribute__((aligned(16))) = {0x1db710641ull, 0x1f7011641ull};

__attribute__((target("pclmul,sse4.1")))
static inline __m128i fold(__m128i acc, __m128i k, __m128i next)
{
    __m128i lo = _mm_clmulepi64_si128(acc, k, 0x00);
    __m128i hi = _mm_clmulepi64_si128(acc, k, 0x11);
    return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}

/* Raw register over len bytes, len >= 64 and a multiple of 16. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t clmul_raw(uint32_t crc, const unsigned char *p, size_t len)
{
    const __m128i k12 = _mm_load_si128((const __m128i *)K1_K2);
    __m128i a0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)crc));
    __m128i a1 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i a2 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i a3 = _mm_loadu_si128((const __m128i *)(p + 48));
    p += 64;
    len -= 64;
    for (; len >= 64; p += 64, len -= 64) {
        a0 = fold(a0, k12, _mm_loadu_si128((const __m128i *)p));
        a1 = fold(a1, k12, _mm_loadu_si128((const __m128i *)(p + 16)));
        a2 = fold(a2, k12, _mm_loadu_si128((const __m128i *)(p + 32)));
        a3 = fold(a3, k12, _mm_loadu_si128((const __m128i *)(p + 48)));
    }
    /* Four accumulators into one, then the 16-byte blocks that remain. */
    const __m128i k34 = _mm_load_si128((const __m128i *)K3_K4);
    __m128i a = fold(a0, k34, a1);
    a = fold(a, k34, a2);
    a = fold(a, k34, a3);
    for (; len >= 16; p += 16, len -= 16)
        a = fold(a, k34, _mm_loadu_si128((const __m128i *)p));

    /* 128 bits to 64: the low half times x^(128-32)... */
    const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
    __m128i t = _mm_clmulepi64_si128(a, k34, 0x10);
    a = _mm_xor_si128(_mm_srli_si128(a, 8), t);
    /* ...then the low 32 bits times x^64. */
    const __m128i k5 = _mm_load_si128((const __m128i *)K5_0);
    t = _mm_srli_si128(a, 4);
    a = _mm_clmulepi64_si128(_mm_and_si128(a, low32), k5, 0x00);
    a = _mm_xor_si128(a, t);

    /* Barrett: q = (a mod x^32) * mu, remainder = a ^ (q mod x^32) * P. */
    const __m128i pmu = _mm_load_si128((const __m128i *)P_MU);
    t = _mm_clmulepi64_si128(_mm_and_si128(a, low32), pmu, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), pmu, 0x00);
    a = _mm_xor_si128(a, t);
    return (uint32_t)_mm_extract_epi32(a, 1);
}
#endif /* HAVE_CLMUL_PATH */

void fastio_crc32_init(void)
{
    if (initialized)
        return;
    crc_slice8_build(sw_table, POLY);
#ifdef HAVE_CLMUL_PATH
    __builtin_cpu_init();
    use_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
    initialized = 1;
}

uint32_t fastio_crc32(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = buf;
    uint32_t raw = ~crc;
#ifdef HAVE_CLMUL_PATH
    if (use_clmul && len >= 64) {
        size_t folded = len & ~(size_t)15;
        raw = clmul_raw(raw, p, folded);
        p += folded;
        len -= folded;
    }
#endif
    return ~sw_raw(raw, p, len);
}

uint32_t fastio_crc32_shift(uint32_t crc, uint64_t nbytes)
{
    return crc_mulmod(crc, crc_x_pow_bytes(nbytes, POLY), POLY);
}

uint32_t fastio_crc32_software(uint32_t crc, const void *buf, size_t len)
{
    return ~sw_raw(~crc, buf, len);
}

const char *fastio_crc32_backend(void)
{
    return use_clmul ? "pclmul" : "software";
}
