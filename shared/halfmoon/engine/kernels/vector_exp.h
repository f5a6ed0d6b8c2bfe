/* exp for the float32 loops of this folder's kernels. */
#ifndef HALFMOON_VECTOR_EXP_H
#define HALFMOON_VECTOR_EXP_H

#include <math.h>
#include <stdint.h>

/* exp to within a few float ulps (Cephes' expf polynomial), in a form the compiler vectorizes. */
static inline float vector_exp(float x) {
    x = x < -87.3f ? -87.3f : x > 88.7f ? 88.7f : x;  /* not fminf/fmaxf: their NaN rules stop vectorization */
    float k = rintf(x * 1.44269504088896341f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)k + 127) << 23;
    return p * scale.f;
}

#endif
