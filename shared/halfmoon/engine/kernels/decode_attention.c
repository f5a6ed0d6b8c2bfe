/* Decode attention for a whole batch in one call (engine/decode_kernel.py builds and calls it).
 *
 * Each decode sequence has one query per head. It attends every cached key of its spans, which
 * are half-open slot ranges of the head-major cache [kv_heads, slots, head_dim]. The query heads
 * of one KV head share each K and V read (grouped-query attention). Scores, softmax and the
 * weighted sum are in float32. (sequence, KV head) pairs run in parallel on the OpenMP runtime
 * torch has loaded: libgomp.so.1, one pool. */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vector_exp.h"

#define MAX_GROUP 16
#define MAX_DIM 256
/* Keys ahead of the one read whose bfloat16 K and V rows are prefetched (V's for the second pass, from
 * L2). A step reads every sequence's KV once, from DRAM; with bfloat16 rows widened one by one the
 * hardware prefetchers fell behind: 1.13x on one thread with it (benchmarks/decode_attention.py's
 * shapes, AVX-512 build; the AVX2 build unchanged). Float32 rows gained nothing. */
#define PREFETCH_KEYS 32

/* q, out: [batch, heads, dim]; k_cache, v_cache: [kv_heads, slots, dim]; sequence b reads spans
 * span_offsets[b] .. span_offsets[b + 1] - 1 of spans (start, end pairs). scratch holds
 * threads * group * max_context floats. Returns 0, or -1 for shapes it does not handle. */
int decode_attention(int bf16, const void *q, const void *k_cache, const void *v_cache, void *out,
                     int batch, int heads, int kv_heads, int dim, long slots,
                     const int64_t *spans, const int64_t *span_offsets, float scale,
                     float *scratch, long max_context, int threads) {
    int group = heads / kv_heads;
    if (group < 1 || group > MAX_GROUP || heads % kv_heads || dim < 1 || dim > MAX_DIM) return -1;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int b = 0; b < batch; b++) {
        for (int kh = 0; kh < kv_heads; kh++) {
            float *scores = scratch + (long)omp_get_thread_num() * group * max_context;
            float query[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], row[MAX_DIM];
            float top[MAX_GROUP], total[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                load_row(bf16, q, ((long)b * heads + kh * group + g) * dim, dim, query[g]);
                for (int d = 0; d < dim; d++) { query[g][d] *= scale; acc[g][d] = 0.f; }
                top[g] = -FLT_MAX;
                total[g] = 0.f;
            }
            long n = 0;
            for (int64_t s = span_offsets[b]; s < span_offsets[b + 1]; s++) {
                for (int64_t t = spans[2 * s]; t < spans[2 * s + 1]; t++, n++) {
                    if (bf16 && t + PREFETCH_KEYS < spans[2 * s + 1]) {
                        long ahead = ((long)kh * slots + t + PREFETCH_KEYS) * dim * 2;
                        for (int byte = 0; byte < dim * 2; byte += 64) {
                            __builtin_prefetch((const char *)k_cache + ahead + byte);
                            __builtin_prefetch((const char *)v_cache + ahead + byte);
                        }
                    }
                    load_row(bf16, k_cache, ((long)kh * slots + t) * dim, dim, row);
                    for (int g = 0; g < group; g++) {
                        float dot = 0.f;
                        for (int d = 0; d < dim; d++) dot += query[g][d] * row[d];
                        scores[g * max_context + n] = dot;
                        if (dot > top[g]) top[g] = dot;
                    }
                }
            }
            for (int g = 0; g < group; g++) {
                float *sg = scores + g * max_context;
                float sum = 0.f;  /* summed in a local (total might alias sg) so that the loop vectorizes */
                for (long i = 0; i < n; i++) { sg[i] = vector_exp(sg[i] - top[g]); sum += sg[i]; }
                total[g] = sum;
            }
            n = 0;
            for (int64_t s = span_offsets[b]; s < span_offsets[b + 1]; s++) {
                for (int64_t t = spans[2 * s]; t < spans[2 * s + 1]; t++, n++) {
                    load_row(bf16, v_cache, ((long)kh * slots + t) * dim, dim, row);
                    for (int g = 0; g < group; g++) {
                        float p = scores[g * max_context + n];
                        for (int d = 0; d < dim; d++) acc[g][d] += p * row[d];
                    }
                }
            }
            for (int g = 0; g < group; g++) {
                long o = ((long)b * heads + kh * group + g) * dim;
                float inv = 1.f / total[g];
                for (int d = 0; d < dim; d++) {
                    float r = acc[g][d] * inv;
                    if (bf16) ((uint16_t *)out)[o + d] = float_to_bf16(r);
                    else ((float *)out)[o + d] = r;
                }
            }
        }
    }
    return 0;
}
