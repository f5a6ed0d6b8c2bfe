/* Decode attention of one sequence and KV head (decode_attention.c has the contract): the query heads of one
 * KV head share each K and V read (grouped-query attention); scores, softmax and the weighted sum are in
 * float32, one pass over the keys with an online softmax, KEY_TILE keys at a time. decode_attention.c and
 * decode_layers.c both run it, so a sequence's attention rounds the same on either path. */
#ifndef HALFMOON_ATTEND_H
#define HALFMOON_ATTEND_H
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vector_exp.h"

#define MAX_GROUP 16
#define MAX_DIM 256
#define KEY_TILE 16
/* Keys ahead of the one read whose bfloat16 K and V rows are prefetched. A step reads every
 * sequence's KV once, from DRAM, and with bfloat16 rows widened one by one the hardware prefetchers
 * fell behind (benchmarks/decode_attention.py). Float32 rows gained nothing from it. */
#define PREFETCH_KEYS 32

/* The ISA's own vector width: a wider type the compiler would split, and lose to shuffles
 * (16-float vectors ran 7x slower on AVX2). */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX2__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vfloat __attribute__((vector_size(LANES * 4)));
typedef uint16_t vbf16 __attribute__((vector_size(LANES * 2)));
typedef uint32_t vuint __attribute__((vector_size(LANES * 4)));

static inline vfloat load_vector(int bf16, const void *base, long index) {
    vfloat f;
    if (bf16) {
        vbf16 h;
        memcpy(&h, (const uint16_t *)base + index, sizeof h);
        vuint u = __builtin_convertvector(h, vuint) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, (const float *)base + index, sizeof f);
    }
    return f;
}

static inline float lane_sum(vfloat v) {
    float s = 0.f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

/* One call's tensors: query row b at q + b * q_stride (its heads dim apart), out [batch, heads, dim]. */
typedef struct {
    int bf16;
    const void *q, *k_cache, *v_cache;
    void *out;
    long q_stride;
    int heads;
    long slots;
    const int64_t *spans, *span_offsets;
    float scale;
} Call;

/* One sequence and KV head. Called with constant vectors (head_dim / LANES) and group where the
 * shape is a common one, so that the queries and accumulators stay in registers.
 *
 * Tiles are cut at fixed positions of the sequence (every KEY_TILE keys, across span ends), so a
 * result depends on the keys alone and not on where the sequence's blocks lie: a migrated request
 * recomputes the same bits. */
static inline __attribute__((always_inline)) void attend(const Call *c, int b, int kh, const int vectors,
                                                         const int group) {
    const long dim = (long)vectors * LANES;
    vfloat query[MAX_GROUP][MAX_DIM / LANES], acc[MAX_GROUP][MAX_DIM / LANES];
    float top[MAX_GROUP], total[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        long row = (long)b * c->q_stride + (kh * group + g) * dim;
        for (int v = 0; v < vectors; v++) {
            query[g][v] = load_vector(c->bf16, c->q, row + v * LANES) * c->scale;
            acc[g][v] = (vfloat){0};
        }
        top[g] = -FLT_MAX;
        total[g] = 0.f;
    }
    int64_t s = c->span_offsets[b], last = c->span_offsets[b + 1];
    while (s < last && c->spans[2 * s] == c->spans[2 * s + 1]) s++;
    int64_t t = s < last ? c->spans[2 * s] : 0;
    while (s < last) {
        long rows[KEY_TILE];
        float p[MAX_GROUP][KEY_TILE];
        int n = 0;
        for (; n < KEY_TILE && s < last; n++) {
            int64_t end = c->spans[2 * s + 1];
            long row = ((long)kh * c->slots + t) * dim;
            if (c->bf16 && t + PREFETCH_KEYS < end) {
                for (long byte = 0; byte < dim * 2; byte += 64) {
                    __builtin_prefetch((const char *)c->k_cache + (row + PREFETCH_KEYS * dim) * 2 + byte);
                    __builtin_prefetch((const char *)c->v_cache + (row + PREFETCH_KEYS * dim) * 2 + byte);
                }
            }
            vfloat key[MAX_DIM / LANES];
            for (int v = 0; v < vectors; v++) key[v] = load_vector(c->bf16, c->k_cache, row + v * LANES);
            for (int g = 0; g < group; g++) {
                vfloat dot = query[g][0] * key[0];
                for (int v = 1; v < vectors; v++) dot += query[g][v] * key[v];
                p[g][n] = lane_sum(dot);
            }
            rows[n] = row;
            if (++t == end) {
                do s++; while (s < last && c->spans[2 * s] == c->spans[2 * s + 1]);
                if (s < last) t = c->spans[2 * s];
            }
        }
        for (int g = 0; g < group; g++) {
            float tile_top = p[g][0];
            for (int j = 1; j < n; j++) tile_top = p[g][j] > tile_top ? p[g][j] : tile_top;
            float new_top = tile_top > top[g] ? tile_top : top[g];
            float rescale = vector_exp(top[g] - new_top);
            top[g] = new_top;
            for (int j = 0; j < KEY_TILE; j++) p[g][j] = j < n ? vector_exp(p[g][j] - new_top) : 0.f;
            float sum = 0.f;
            for (int j = 0; j < KEY_TILE; j++) sum += p[g][j];
            total[g] = total[g] * rescale + sum;
            if (rescale != 1.f)
                for (int v = 0; v < vectors; v++) acc[g][v] *= rescale;
        }
        for (int j = 0; j < n; j++) {
            vfloat value[MAX_DIM / LANES];
            for (int v = 0; v < vectors; v++) value[v] = load_vector(c->bf16, c->v_cache, rows[j] + v * LANES);
            for (int g = 0; g < group; g++)
                for (int v = 0; v < vectors; v++) acc[g][v] += p[g][j] * value[v];
        }
    }
    for (int g = 0; g < group; g++) {
        long o = ((long)b * c->heads + kh * group + g) * dim;
        float inv = 1.f / total[g];
        for (int v = 0; v < vectors; v++) {
            vfloat r = acc[g][v] * inv;
            for (int i = 0; i < LANES; i++) {
                if (c->bf16) ((uint16_t *)c->out)[o + v * LANES + i] = float_to_bf16(r[i]);
                else ((float *)c->out)[o + v * LANES + i] = r[i];
            }
        }
    }
}

/* attend() with constants for the common shapes. */
static void attend_unit(const Call *c, int b, int kh, int dim, int group) {
#define GROUPS(vectors)                                                  \
    switch (group) {                                                     \
        case 1: attend(c, b, kh, vectors, 1); break;                     \
        case 2: attend(c, b, kh, vectors, 2); break;                     \
        case 3: attend(c, b, kh, vectors, 3); break;                     \
        case 4: attend(c, b, kh, vectors, 4); break;                     \
        case 5: attend(c, b, kh, vectors, 5); break;                     \
        case 6: attend(c, b, kh, vectors, 6); break;                     \
        case 7: attend(c, b, kh, vectors, 7); break;                     \
        case 8: attend(c, b, kh, vectors, 8); break;                     \
        default: attend(c, b, kh, vectors, group);                       \
    }
    switch (dim) {
        case 64: GROUPS(64 / LANES) break;
        case 128: GROUPS(128 / LANES) break;
        default: GROUPS(dim / LANES)
    }
#undef GROUPS
}

/* Whether attend_unit takes this shape: head_dim a multiple of the vector width, up to MAX_DIM, and a group
 * of query heads per KV head up to MAX_GROUP. */
static inline int attend_takes(int heads, int kv_heads, int dim) {
    int group = heads / kv_heads;
    return group >= 1 && group <= MAX_GROUP && heads % kv_heads == 0 && dim >= LANES && dim <= MAX_DIM
           && dim % LANES == 0;
}
#endif
