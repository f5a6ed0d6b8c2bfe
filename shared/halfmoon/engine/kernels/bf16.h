/* bfloat16 <-> float, rounding to nearest even as torch does. */
#ifndef HALFMOON_BF16_H
#define HALFMOON_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    return (uint16_t)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16);
}

/* dim elements of base (bfloat16 where bf16, else float) from index on, as floats into out. */
static inline void load_row(int bf16, const void *base, long index, int dim, float *out) {
    if (bf16) {
        const uint16_t *row = (const uint16_t *)base + index;
        for (int d = 0; d < dim; d++) out[d] = bf16_to_float(row[d]);
    } else {
        memcpy(out, (const float *)base + index, dim * sizeof(float));
    }
}

/* A float rounded through bfloat16, as a torch op whose output is bfloat16 leaves it. */
static inline float through_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }
#endif
