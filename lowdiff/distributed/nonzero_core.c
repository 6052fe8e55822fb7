/* nonzero_core.c - see nonzero_core.h. */
#include "nonzero_core.h"

#include <string.h>

#define BLOCK_BYTES 32

/* One loop per element size, so that the compiler sees fixed-size loads. A block of zeros is
 * passed over with one test; the elements of any other block (and of the short last one) are
 * looked at one by one. */
#define DEFINE_SCAN(NAME, TYPE)                                                                   \
    static int64_t NAME(const TYPE *src, int64_t count, int32_t *positions, TYPE *values,         \
                        int64_t capacity) {                                                       \
        const int64_t per_block = BLOCK_BYTES / (int64_t)sizeof(TYPE);                            \
        int64_t found = 0;                                                                        \
        for (int64_t i = 0; i < count; i += per_block) {                                          \
            const int64_t end = count - i < per_block ? count : i + per_block;                    \
            if (end - i == per_block) {                                                           \
                uint64_t words[BLOCK_BYTES / 8];                                                  \
                memcpy(words, src + i, BLOCK_BYTES); /* alignment-safe; compiles to plain loads */\
                if ((words[0] | words[1] | words[2] | words[3]) == 0)                             \
                    continue;                                                                     \
            }                                                                                     \
            for (int64_t j = i; j < end; j++) {                                                   \
                if (src[j] != 0) {                                                                \
                    if (found < capacity) {                                                       \
                        positions[found] = (int32_t)j;                                            \
                        values[found] = src[j];                                                   \
                    }                                                                             \
                    found++;                                                                      \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
        return found;                                                                             \
    }

DEFINE_SCAN(scan8, uint8_t)
DEFINE_SCAN(scan16, uint16_t)
DEFINE_SCAN(scan32, uint32_t)
DEFINE_SCAN(scan64, uint64_t)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_SCAN32_AVX2 1

/* 4-byte elements (float32, the usual gradient) with AVX2, chosen at run time. The loop above is
 * bound by its branches, not by memory: at the density of a top-k aggregate (a few percent) about
 * one 32-byte block in seven holds something, unpredictably, and inside it every element is a
 * branch. Here each block of 8 costs the same few instructions whatever it holds: compare with
 * zero, take the mask of non-zero lanes, move those lanes to the front with one permutation (the
 * lane numbers come from a table indexed by the mask) and store all 8 values and positions at the
 * end of the output, advancing it by the mask's popcount. Stores of 8 lanes need 8 free slots, so
 * the last slots before `capacity` are filled by the scalar loop, which also does the tail. */
static int32_t pack_lanes[256][8];

__attribute__((constructor)) static void build_pack_lanes(void) {
    for (int mask = 0; mask < 256; mask++) {
        int n = 0;
        for (int lane = 0; lane < 8; lane++)
            if (mask & (1 << lane))
                pack_lanes[mask][n++] = lane;
        while (n < 8)
            pack_lanes[mask][n++] = 0;
    }
}

__attribute__((target("avx2,popcnt"))) static int64_t scan32_avx2(const uint32_t *src, int64_t count,
                                                                   int32_t *positions, uint32_t *values,
                                                                   int64_t capacity) {
    int64_t found = 0, i = 0;
    const __m256i zero = _mm256_setzero_si256();
    for (; i + 8 <= count && found + 8 <= capacity; i += 8) {
        const __m256i block = _mm256_loadu_si256((const __m256i *)(src + i));
        const unsigned zeros = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(block, zero)));
        const unsigned mask = ~zeros & 0xFFu;
        const __m256i lanes = _mm256_loadu_si256((const __m256i *)pack_lanes[mask]);
        _mm256_storeu_si256((__m256i *)(values + found), _mm256_permutevar8x32_epi32(block, lanes));
        _mm256_storeu_si256((__m256i *)(positions + found), _mm256_add_epi32(lanes, _mm256_set1_epi32((int32_t)i)));
        found += __builtin_popcount(mask);
    }
    for (; i < count; i++) {
        if (src[i] != 0) {
            if (found < capacity) {
                positions[found] = (int32_t)i;
                values[found] = src[i];
            }
            found++;
        }
    }
    return found;
}
#endif

static int64_t scan32_best(const uint32_t *src, int64_t count, int32_t *positions, uint32_t *values,
                           int64_t capacity) {
#ifdef HAVE_SCAN32_AVX2
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt"))
        return scan32_avx2(src, count, positions, values, capacity);
#endif
    return scan32(src, count, positions, values, capacity);
}

int64_t lowdiff_nonzero(const void *src, int64_t count, int itemsize, int32_t *positions, void *values,
                        int64_t capacity) {
    if (count < 0 || count > INT32_MAX)
        return -1;
    switch (itemsize) {
    case 1: return scan8((const uint8_t *)src, count, positions, (uint8_t *)values, capacity);
    case 2: return scan16((const uint16_t *)src, count, positions, (uint16_t *)values, capacity);
    case 4: return scan32_best((const uint32_t *)src, count, positions, (uint32_t *)values, capacity);
    case 8: return scan64((const uint64_t *)src, count, positions, (uint64_t *)values, capacity);
    default: return -1;
    }
}
