/* The elementwise math of a Llama-family decoder layer on bfloat16 rows, one pass each, bit for bit
 * what transformers' modules compute in PyTorch (engine/layer_ops.py builds and calls them):
 * RMSNorm (optionally after adding a residual), rotary embedding and SiLU-and-multiply. Each
 * intermediate that PyTorch stores as bfloat16 is rounded through bfloat16 here too. Rows are
 * spread over the OpenMP runtime torch has loaded (libgomp.so.1, one pool). Also the store of a
 * step's K and V rows into the paged cache, which is a copy in any dtype. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vector_exp.h"

/* Rows worth a parallel region: a decode step's few rows cost less than waking the other threads. */
#define PARALLEL_ROWS 16

/* out = weight * bf16(h * rsqrt(mean(h^2) + eps)), h = x (residual NULL) or h = bf16(x + residual),
 * which is also stored to sum_out. All [rows, dim] contiguous; weight [dim]. */
void rms_norm(const uint16_t *x, const uint16_t *residual, uint16_t *sum_out, const uint16_t *weight,
              uint16_t *out, long rows, int dim, float eps, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (long r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * dim;
        const uint16_t *h = xr;
        if (residual) {
            const uint16_t *rr = residual + r * dim;
            uint16_t *sr = sum_out + r * dim;
            for (int d = 0; d < dim; d++) sr[d] = float_to_bf16(bf16_to_float(xr[d]) + bf16_to_float(rr[d]));
            h = sr;
        }
        float squares = 0.f;
        for (int d = 0; d < dim; d++) { float v = bf16_to_float(h[d]); squares += v * v; }
        float inv = 1.f / sqrtf(squares / (float)dim + eps);
        uint16_t *o = out + r * dim;
        for (int d = 0; d < dim; d++)
            o[d] = float_to_bf16(bf16_to_float(weight[d]) * through_bf16(bf16_to_float(h[d]) * inv));
    }
}

/* In place on x [rows, heads, dim] with row stride row_stride (elements), cos and sin [rows, dim]:
 * x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half(x) = (-x2, x1). */
void rotary(uint16_t *x, long row_stride, const uint16_t *cos, const uint16_t *sin, long rows, int heads,
            int dim, int threads) {
    int half = dim / 2;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (long r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * dim, *s = sin + r * dim;
        for (int h = 0; h < heads; h++) {
            uint16_t *v = x + r * row_stride + (long)h * dim;
            for (int d = 0; d < half; d++) {
                float x1 = bf16_to_float(v[d]), x2 = bf16_to_float(v[d + half]);
                float lo = through_bf16(x1 * bf16_to_float(c[d])) + through_bf16(-x2 * bf16_to_float(s[d]));
                float hi = through_bf16(x2 * bf16_to_float(c[d + half])) + through_bf16(x1 * bf16_to_float(s[d + half]));
                v[d] = float_to_bf16(lo);
                v[d + half] = float_to_bf16(hi);
            }
        }
    }
}

/* out [rows, half] = bf16(bf16(silu(gate)) * up), gate_up [rows, 2 * half] the gate half then the up half. */
void silu_mul(const uint16_t *gate_up, uint16_t *out, long rows, long half, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (long r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * half, *u = g + half;
        uint16_t *o = out + r * half;
        for (long d = 0; d < half; d++) {
            float x = bf16_to_float(g[d]);
            o[d] = float_to_bf16(through_bf16(x / (1.f + vector_exp(-x))) * bf16_to_float(u[d]));
        }
    }
}

/* K and V rows [tokens, kv_heads, dim] (k_stride, v_stride elements between tokens; heads dim apart) into the
 * head-major caches [kv_heads, cache_slots, dim] at slots[t]; elements of element_bytes. */
void store_kv(const char *k, long k_stride, const char *v, long v_stride, char *k_cache, char *v_cache,
              long cache_slots, const int64_t *slots, long tokens, int kv_heads, int dim, int element_bytes) {
    size_t row = (size_t)dim * element_bytes;
    for (long t = 0; t < tokens; t++) {
        for (int h = 0; h < kv_heads; h++) {
            size_t at = ((size_t)h * cache_slots + slots[t]) * row;
            memcpy(k_cache + at, k + ((size_t)t * k_stride + (size_t)h * dim) * element_bytes, row);
            memcpy(v_cache + at, v + ((size_t)t * v_stride + (size_t)h * dim) * element_bytes, row);
        }
    }
}
