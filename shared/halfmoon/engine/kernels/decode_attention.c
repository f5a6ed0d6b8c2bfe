/* Decode attention for a whole batch in one call (engine/decode_kernel.py builds and calls it).
 *
 * Each decode sequence has one query per head. It attends every cached key of its spans, which
 * are half-open slot ranges of the head-major cache [kv_heads, slots, head_dim]. The query heads
 * of one KV head share each K and V read (grouped-query attention). Scores, softmax and the
 * weighted sum are in float32, one pass over the keys with an online softmax, KEY_TILE keys at a
 * time. (sequence, KV head) pairs run in parallel on the OpenMP runtime torch has loaded:
 * libgomp.so.1, one pool. */
#include <omp.h>
#include <stdint.h>

#include "attend.h"

/* q, out: [batch, heads, dim]; k_cache, v_cache: [kv_heads, slots, dim]; sequence b reads spans
 * span_offsets[b] .. span_offsets[b + 1] - 1 of spans (start, end pairs). Returns 0, or -1 for
 * shapes it does not take (attend_takes). */
int decode_attention(int bf16, const void *q, const void *k_cache, const void *v_cache, void *out,
                     int batch, int heads, int kv_heads, int dim, long slots,
                     const int64_t *spans, const int64_t *span_offsets, float scale, int threads) {
    if (!attend_takes(heads, kv_heads, dim))
        return -1;
    Call c = {bf16, q, k_cache, v_cache, out, (long)heads * dim, heads, slots, spans, span_offsets, scale};
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int b = 0; b < batch; b++)
        for (int kh = 0; kh < kv_heads; kh++)
            attend_unit(&c, b, kh, dim, heads / kv_heads);
    return 0;
}
