/* Decode attention for a whole batch in one call (engine/decode_kernel.py builds and calls it).
 *
 * Each decode sequence has one query per head. It attends every cached key of its spans, which
 * are half-open slot ranges of the head-major cache [kv_heads, slots, head_dim]. The query heads
 * of one KV head share each K and V read (grouped-query attention). Keys are taken 16 at a time
 * with an online softmax (flash decoding's order), so the scores never leave registers and K and V
 * are read once. A key's score is a 16-lane partial sum of its head dimension; the 16 keys' partial
 * sums are folded together into one vector of 16 scores (a transposing reduction), which costs a
 * few shuffles per key where a horizontal sum per key and query head costs a dependent chain.
 * Float32 throughout. (sequence, KV head) pairs run in parallel on the OpenMP runtime torch has
 * loaded: libgomp.so.1, one pool. */
#include <float.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vector_exp.h"

#define KEY_TILE 16
#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_VECS (MAX_DIM / 16)
/* Keys ahead of the one loaded whose rows are prefetched: a decode step reads every sequence's KV once,
 * from DRAM, and the hardware prefetchers alone left the kernel waiting on memory half of its time. */
#define PREFETCH_KEYS 64

/* 16 floats: the compiler maps it onto the ISA's vectors (one zmm, two ymm or four xmm). */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#ifdef __clang__
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v16i){__VA_ARGS__})
#endif

static inline v16 vload(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, v16 v) { memcpy(p, &v, sizeof v); }

typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

/* Row index of a bfloat16 base, dim a multiple of 16, as floats into out. */
static inline void widen_row(const void *base, long index, int dim, float *out) {
    const uint16_t *row = (const uint16_t *)base + index;
    for (int c = 0; c < dim; c += 16) {
        v16h h;
        memcpy(&h, row + c, sizeof h);
        v16u wide = __builtin_convertvector(h, v16u) << 16;
        memcpy(out + c, &wide, sizeof wide);
    }
}

/* Lane j of the result is the sum of the 16 lanes of part[j]. Each round halves the lanes each key
 * holds and doubles the keys a vector holds, in key order. */
static inline v16 sum_lanes_transposed(const v16 part[KEY_TILE]) {
    v16 r8[8], r4[4], r2[2];
    for (int i = 0; i < 8; i++)
        r8[i] = SHUFFLE(part[2 * i], part[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
              + SHUFFLE(part[2 * i], part[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        r4[i] = SHUFFLE(r8[2 * i], r8[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
              + SHUFFLE(r8[2 * i], r8[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        r2[i] = SHUFFLE(r4[2 * i], r4[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
              + SHUFFLE(r4[2 * i], r4[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(r2[0], r2[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUFFLE(r2[0], r2[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* One (sequence, KV head)'s running state: its query heads' scaled queries, the running maximum and
 * sum of their softmax, and their weighted sums of values. */
typedef struct {
    v16 query[MAX_GROUP][MAX_VECS], acc[MAX_GROUP][MAX_VECS];
    float top[MAX_GROUP], total[MAX_GROUP];
} Heads;

/* Folds keys k[0 .. n) (values v) into every query head's state; rows n .. KEY_TILE - 1 point at zeros.
 * Inlined into one copy per common head_dim (attend_64, attend_128), where the loops over the head
 * dimension unroll and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_tile(Heads *h, int group, int vecs, const float *const *kf, const float *const *vf,
                        int n) {
    float valid[KEY_TILE];  /* 1 for the tile's keys, 0 for its padding: multiplied, not branched on, to vectorize */
    for (int j = 0; j < KEY_TILE; j++) valid[j] = j < n ? 1.f : 0.f;
    for (int g = 0; g < group; g++) {
        v16 part[KEY_TILE];
        for (int j = 0; j < KEY_TILE; j++) {
            v16 s = h->query[g][0] * vload(kf[j]);
            for (int c = 1; c < vecs; c++) s += h->query[g][c] * vload(kf[j] + 16 * c);
            part[j] = s;
        }
        float score[KEY_TILE], p[KEY_TILE];
        vstore(score, sum_lanes_transposed(part));
        float top = h->top[g];
        for (int j = 0; j < KEY_TILE; j++) { float masked = score[j] + (valid[j] - 1.f) * FLT_MAX; top = masked > top ? masked : top; }
        float sum = 0.f;
        for (int j = 0; j < KEY_TILE; j++) {
            p[j] = vector_exp(score[j] - top) * valid[j];
            sum += p[j];
        }
        float rescale = vector_exp(h->top[g] - top);
        h->top[g] = top;
        h->total[g] = h->total[g] * rescale + sum;
        int c = 0;
        for (; c + 4 <= vecs; c += 4) {  /* four independent sums: one would wait on each FMA's latency */
            v16 a0 = h->acc[g][c] * rescale, a1 = h->acc[g][c + 1] * rescale;
            v16 a2 = h->acc[g][c + 2] * rescale, a3 = h->acc[g][c + 3] * rescale;
            for (int j = 0; j < KEY_TILE; j++) {
                const float *v = vf[j] + 16 * c;
                a0 += p[j] * vload(v); a1 += p[j] * vload(v + 16); a2 += p[j] * vload(v + 32); a3 += p[j] * vload(v + 48);
            }
            h->acc[g][c] = a0; h->acc[g][c + 1] = a1; h->acc[g][c + 2] = a2; h->acc[g][c + 3] = a3;
        }
        for (; c < vecs; c++) {
            v16 a = h->acc[g][c] * rescale;
            for (int j = 0; j < KEY_TILE; j++) a += p[j] * vload(vf[j] + 16 * c);
            h->acc[g][c] = a;
        }
    }
}

static const float ZEROS[MAX_DIM];

typedef void (*AttendTile)(Heads *, int, int, const float *const *, const float *const *, int);

static void attend_64(Heads *h, int group, int vecs, const float *const *kf, const float *const *vf, int n) {
    (void)vecs;
    attend_tile(h, group, 4, kf, vf, n);
}

static void attend_128(Heads *h, int group, int vecs, const float *const *kf, const float *const *vf, int n) {
    (void)vecs;
    attend_tile(h, group, 8, kf, vf, n);
}

static void attend_any(Heads *h, int group, int vecs, const float *const *kf, const float *const *vf, int n) {
    attend_tile(h, group, vecs, kf, vf, n);
}

/* q, out: [batch, heads, dim]; k_cache, v_cache: [kv_heads, slots, dim]; sequence b reads spans
 * span_offsets[b] .. span_offsets[b + 1] - 1 of spans (start, end pairs), at least one key in all.
 * Returns 0, or -1 for shapes it does not handle (head_dim must be a multiple of 16, at most 256). */
int decode_attention(int bf16, const void *q, const void *k_cache, const void *v_cache, void *out,
                     int batch, int heads, int kv_heads, int dim, long slots,
                     const int64_t *spans, const int64_t *span_offsets, float scale, int threads) {
    int group = heads / kv_heads;
    if (group < 1 || group > MAX_GROUP || heads % kv_heads || dim < 16 || dim > MAX_DIM || dim % 16) return -1;
    int vecs = dim / 16;
    long element = bf16 ? 2 : 4;
    AttendTile attend = dim == 64 ? attend_64 : dim == 128 ? attend_128 : attend_any;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int b = 0; b < batch; b++) {
        for (int kh = 0; kh < kv_heads; kh++) {
            Heads h;
            float kt[KEY_TILE][MAX_DIM], vt[KEY_TILE][MAX_DIM], row[MAX_DIM];
            const float *kf[KEY_TILE], *vf[KEY_TILE];  /* float32 rows are read in place, bfloat16 ones widened */
            for (int g = 0; g < group; g++) {
                load_row(bf16, q, ((long)b * heads + kh * group + g) * dim, dim, row);
                for (int c = 0; c < vecs; c++) {
                    h.query[g][c] = vload(row + 16 * c) * scale;
                    h.acc[g][c] = (v16){0};
                }
                h.top[g] = -FLT_MAX;
                h.total[g] = 0.f;
            }
            int n = 0;
            for (int64_t s = span_offsets[b]; s < span_offsets[b + 1]; s++) {
                for (int64_t t = spans[2 * s]; t < spans[2 * s + 1]; t++) {
                    if (t + PREFETCH_KEYS < spans[2 * s + 1]) {
                        long ahead = ((long)kh * slots + t + PREFETCH_KEYS) * dim * element;
                        for (long byte = 0; byte < dim * element; byte += 64) {
                            __builtin_prefetch((const char *)k_cache + ahead + byte);
                            __builtin_prefetch((const char *)v_cache + ahead + byte);
                        }
                    }
                    long index = ((long)kh * slots + t) * dim;
                    if (bf16) {
                        widen_row(k_cache, index, dim, kt[n]);
                        widen_row(v_cache, index, dim, vt[n]);
                        kf[n] = kt[n];
                        vf[n] = vt[n];
                    } else {
                        kf[n] = (const float *)k_cache + index;
                        vf[n] = (const float *)v_cache + index;
                    }
                    if (++n == KEY_TILE) {
                        attend(&h, group, vecs, kf, vf, n);
                        n = 0;
                    }
                }
            }
            if (n) {
                for (int j = n; j < KEY_TILE; j++) kf[j] = vf[j] = ZEROS;
                attend(&h, group, vecs, kf, vf, n);
            }
            for (int g = 0; g < group; g++) {
                long o = ((long)b * heads + kh * group + g) * dim;
                float inv = 1.f / h.total[g];
                for (int c = 0; c < vecs; c++) vstore(row + 16 * c, h.acc[g][c] * inv);
                for (int d = 0; d < dim; d++) {
                    if (bf16) ((uint16_t *)out)[o + d] = float_to_bf16(row[d]);
                    else ((float *)out)[o + d] = row[d];
                }
            }
        }
    }
    return 0;
}
