/* The elementwise math of a Llama-family decoder layer on bfloat16 rows, one pass each, bit for bit
 * what transformers' modules compute in PyTorch (engine/layer_ops.py builds and calls them):
 * RMSNorm (optionally after adding a residual), rotary embedding and SiLU-and-multiply, a row at a time
 * by layer_math.h. Rows are spread over the OpenMP runtime torch has loaded (libgomp.so.1, one pool).
 * Also the store of a step's K and V rows into the paged cache, which is a copy in any dtype. */
#include <stdint.h>
#include <string.h>

#include "layer_math.h"

/* Rows worth a parallel region: a decode step's few rows cost less than waking the other threads. */
#define PARALLEL_ROWS 16

/* layer_math.h's rms_norm_row over [rows, dim] contiguous rows; sum_out is written where residual is given. */
void rms_norm(const uint16_t *x, const uint16_t *residual, uint16_t *sum_out, const uint16_t *weight,
              uint16_t *out, long rows, int dim, float eps, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (long r = 0; r < rows; r++)
        rms_norm_row(x + r * dim, residual ? residual + r * dim : NULL, residual ? sum_out + r * dim : NULL, weight,
                     out + r * dim, dim, eps);
}

/* In place on x [rows, heads, dim] with row stride row_stride (elements), cos and sin [rows, dim]. */
void rotary(uint16_t *x, long row_stride, const uint16_t *cos, const uint16_t *sin, long rows, int heads,
            int dim, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (long r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++)
            rotary_head(x + r * row_stride + (long)h * dim, cos + r * dim, sin + r * dim, dim);
}

/* out [rows, half] from gate_up [rows, 2 * half]. */
void silu_mul(const uint16_t *gate_up, uint16_t *out, long rows, long half, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (long r = 0; r < rows; r++)
        silu_mul_row(gate_up + r * 2 * half, out + r * half, half);
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
