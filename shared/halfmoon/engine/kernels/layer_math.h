/* One row of each elementwise step of a Llama-family decoder layer on bfloat16, bit for bit what
 * transformers' modules compute in PyTorch: each intermediate that PyTorch stores as bfloat16 is rounded
 * through bfloat16 here too. layer_ops.c spreads rows of them over threads; decode_layers.c calls them
 * inside its own layers. One definition for both, so a row rounds the same on either path. */
#ifndef HALFMOON_LAYER_MATH_H
#define HALFMOON_LAYER_MATH_H
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "vector_exp.h"

/* out = weight * bf16(h * rsqrt(mean(h^2) + eps)), h = x (residual NULL) or h = bf16(x + residual), which
 * is also stored to sum (which may be residual itself). Rows of dim; weight [dim]. */
static inline void rms_norm_row(const uint16_t *x, const uint16_t *residual, uint16_t *sum, const uint16_t *weight,
                                uint16_t *out, int dim, float eps) {
    const uint16_t *h = x;
    if (residual) {
        for (int d = 0; d < dim; d++) sum[d] = float_to_bf16(bf16_to_float(x[d]) + bf16_to_float(residual[d]));
        h = sum;
    }
    float squares = 0.f;
    for (int d = 0; d < dim; d++) { float v = bf16_to_float(h[d]); squares += v * v; }
    float inv = 1.f / sqrtf(squares / (float)dim + eps);
    for (int d = 0; d < dim; d++)
        out[d] = float_to_bf16(bf16_to_float(weight[d]) * through_bf16(bf16_to_float(h[d]) * inv));
}

/* In place on one head v [dim] with its token's cos and sin [dim]:
 * v = bf16(bf16(v * cos) + bf16(rotate_half(v) * sin)), rotate_half(v) = (-v2, v1). */
static inline void rotary_head(uint16_t *v, const uint16_t *c, const uint16_t *s, int dim) {
    int half = dim / 2;
    for (int d = 0; d < half; d++) {
        float x1 = bf16_to_float(v[d]), x2 = bf16_to_float(v[d + half]);
        float lo = through_bf16(x1 * bf16_to_float(c[d])) + through_bf16(-x2 * bf16_to_float(s[d]));
        float hi = through_bf16(x2 * bf16_to_float(c[d + half])) + through_bf16(x1 * bf16_to_float(s[d + half]));
        v[d] = float_to_bf16(lo);
        v[d + half] = float_to_bf16(hi);
    }
}

/* out [half] = bf16(bf16(silu(gate)) * up), gate_up [2 * half] the gate half then the up half. */
static inline void silu_mul_row(const uint16_t *gate_up, uint16_t *out, long half) {
    const uint16_t *u = gate_up + half;
    for (long d = 0; d < half; d++) {
        float x = bf16_to_float(gate_up[d]);
        out[d] = float_to_bf16(through_bf16(x / (1.f + vector_exp(-x))) * bf16_to_float(u[d]));
    }
}
#endif
