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

int64_t lowdiff_nonzero(const void *src, int64_t count, int itemsize, int32_t *positions, void *values,
                        int64_t capacity) {
    if (count < 0 || count > INT32_MAX)
        return -1;
    switch (itemsize) {
    case 1: return scan8((const uint8_t *)src, count, positions, (uint8_t *)values, capacity);
    case 2: return scan16((const uint16_t *)src, count, positions, (uint16_t *)values, capacity);
    case 4: return scan32((const uint32_t *)src, count, positions, (uint32_t *)values, capacity);
    case 8: return scan64((const uint64_t *)src, count, positions, (uint64_t *)values, capacity);
    default: return -1;
    }
}
