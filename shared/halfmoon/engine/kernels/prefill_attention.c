/* Causal attention for a step's prompt chunks in one call (engine/prefill_kernel.py builds and calls it).
 *
 * A chunk of query_len tokens sits at the end of a context of context_len tokens (the earlier ones cached),
 * so its query t, at position context_len - query_len + t, attends keys 0 .. that position. Keys and values
 * are read from the head-major cache [kv_heads, slots, head_dim] through the sequence's slot map (slot of
 * each context position). The work is split into (sequence, KV head, tile of query positions); a tile's
 * rows are its positions times the query heads of that KV head, so every K and V tile read serves all of
 * them. Keys are taken a tile at a time with an online softmax (flash attention's order), K transposed
 * into float32 once per tile so that the scores of a row are computed across keys, vectorized, and the
 * values weighted across the head dimension. Float32 throughout, as the decode kernel, except where the
 * CPU has AVX512-BF16 (the avx512bf16 level) and the inputs are bfloat16: there both products take pairs
 * of bfloat16 (vdpbf16ps) into float32 sums, half the instructions of converting first, and the
 * probabilities are rounded to bfloat16 before weighting the values (the normalizer sums the rounded
 * ones), as flash attention on GPUs rounds them. Work items run on torch's OpenMP runtime, dynamically
 * scheduled: causal tiles near a chunk's end hold more keys. */
#include <float.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vector_exp.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#define BF16_DOT 1
#else
#define BF16_DOT 0
#endif

#define KEY_TILE 64
#define ROWS_PER_TILE 64
#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_SEQS 4096
/* Rows computed together: their accumulators stay in registers (4 rows x 4 vectors of 16 floats fill
 * AVX-512's 32 registers halfway; AVX2 splits each vector in two, so 2 rows there). */
#ifdef __AVX512F__
#define ROW_BLOCK 4
#else
#define ROW_BLOCK 2
#endif

/* 16 floats: the compiler maps it onto the ISA's vectors (one zmm, two ymm or four xmm). */
typedef float v16 __attribute__((vector_size(64)));

typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 vload(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline v16 vbroadcast(float x) { return (v16){0} + x; }
static inline void vstore(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline int tile_positions(int group) { return ROWS_PER_TILE / group > 0 ? ROWS_PER_TILE / group : 1; }

static inline long padded_rows(int group) {
    long rows = (long)tile_positions(group) * group;
    return (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
}

/* Floats of scratch each thread needs for head_dim dim and group query heads per KV head. */
long prefill_attention_scratch(int group, int dim) {
    long rows = padded_rows(group);
    return rows * dim * 2 + rows * KEY_TILE + 2L * KEY_TILE * dim + 3 * rows + (BF16_DOT ? rows * KEY_TILE / 2 : 0);
}

/* Keys k0 .. k0 + n - 1 (their slots in slot_of) of KV head row offset head_base into kt, transposed
 * ([dim][KEY_TILE]), and vf ([KEY_TILE][dim]), in float32; the tile's unused keys are zeros. */
static void load_tile(int bf16, const void *k_cache, const void *v_cache, const int64_t *slot_of, int n,
                      long head_base, int dim, float *kt, float *vf) {
    float row[MAX_DIM];
    for (int j = 0; j < KEY_TILE; j++) {
        if (j < n) {
            long base = (head_base + slot_of[j]) * dim;
            load_row(bf16, k_cache, base, dim, row);
            load_row(bf16, v_cache, base, dim, vf + (long)j * dim);
        } else {
            memset(row, 0, dim * sizeof(float));
            memset(vf + (long)j * dim, 0, dim * sizeof(float));
        }
        for (int d = 0; d < dim; d++) kt[(long)d * KEY_TILE + j] = row[d];
    }
}

/* scores[r][0..KEY_TILE) = q[r] . k[j] for rows r0 .. r0 + ROW_BLOCK - 1, the tile's 64 keys as four vectors. */
static void block_scores(const float *qf, const float *kt, float *scores, int r0, int dim) {
    v16 s[ROW_BLOCK][4] = {{{0}}};
    for (int d = 0; d < dim; d++) {
        const float *kd = kt + (long)d * KEY_TILE;
        v16 k0 = vload(kd), k1 = vload(kd + 16), k2 = vload(kd + 32), k3 = vload(kd + 48);
        for (int b = 0; b < ROW_BLOCK; b++) {
            float qd = qf[(long)(r0 + b) * dim + d];
            s[b][0] += qd * k0; s[b][1] += qd * k1; s[b][2] += qd * k2; s[b][3] += qd * k3;
        }
    }
    for (int b = 0; b < ROW_BLOCK; b++)
        for (int c = 0; c < 4; c++) vstore(scores + (long)(r0 + b) * KEY_TILE + 16 * c, s[b][c]);
}

/* acc[r] = acc[r] * rescale[r] + sum_j p[r][j] v[j] for rows r0 .. r0 + ROW_BLOCK - 1 over keys 0 .. n - 1:
 * the head dimension 64 at a time, then 16 at a time. */
static void block_values(const float *p, const float *vf, const float *rescale, float *acc, int r0, int n, int dim) {
    int c0 = 0;
    for (; c0 + 64 <= dim; c0 += 64) {
        v16 a[ROW_BLOCK][4];
        for (int b = 0; b < ROW_BLOCK; b++)
            for (int c = 0; c < 4; c++) a[b][c] = vload(acc + (long)(r0 + b) * dim + c0 + 16 * c) * rescale[r0 + b];
        for (int j = 0; j < n; j++) {
            const float *vj = vf + (long)j * dim + c0;
            v16 v0 = vload(vj), v1 = vload(vj + 16), v2 = vload(vj + 32), v3 = vload(vj + 48);
            for (int b = 0; b < ROW_BLOCK; b++) {
                float pj = p[(long)(r0 + b) * KEY_TILE + j];
                a[b][0] += pj * v0; a[b][1] += pj * v1; a[b][2] += pj * v2; a[b][3] += pj * v3;
            }
        }
        for (int b = 0; b < ROW_BLOCK; b++)
            for (int c = 0; c < 4; c++) vstore(acc + (long)(r0 + b) * dim + c0 + 16 * c, a[b][c]);
    }
    for (; c0 < dim; c0 += 16) {
        v16 a[ROW_BLOCK];
        for (int b = 0; b < ROW_BLOCK; b++) a[b] = vload(acc + (long)(r0 + b) * dim + c0) * rescale[r0 + b];
        for (int j = 0; j < n; j++) {
            v16 v = vload(vf + (long)j * dim + c0);
            for (int b = 0; b < ROW_BLOCK; b++) a[b] += p[(long)(r0 + b) * KEY_TILE + j] * v;
        }
        for (int b = 0; b < ROW_BLOCK; b++) vstore(acc + (long)(r0 + b) * dim + c0, a[b]);
    }
}

/* The largest of start and s[0 .. valid), 16 lanes at a time: a chain of scalar maxima (gcc vectorizes no
 * float maximum without finite-math-only) took a tenth of the kernel. */
static inline float tile_max(const float *s, int valid, float start) {
    v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    v16 top = vbroadcast(start);
    for (int c = 0; c < valid; c += 16) {
        v16 x = vload(s + c);
        v16i keep = (lane + c < valid) & (x > top);  /* -1 where x is a valid key's score above top */
        top = (v16)(((v16i)x & keep) | ((v16i)top & ~keep));
    }
    float result = top[0];
    for (int i = 1; i < 16; i++) result = top[i] > result ? top[i] : result;
    return result;
}

/* Row s's scores of a tile, of which the first valid keys are at or before its position, to the tile's
 * probabilities against the row's running top (top, total and rescale updated for the row); where pb, each
 * probability is rounded to bfloat16 there, for the value products, and summed as rounded. */
static inline void tile_softmax(float *s, int valid, float *top, float *total, float *rescale, uint16_t *pb) {
    if (valid <= 0) {  /* every key of this tile is after this row's position */
        for (int j = 0; j < KEY_TILE; j++) s[j] = 0.f;
        if (pb) memset(pb, 0, KEY_TILE * sizeof(uint16_t));
        *rescale = 1.f;
        return;
    }
    float tile_top = tile_max(s, valid, *top);
    *rescale = vector_exp(*top - tile_top);
    *top = tile_top;
    float sum = 0.f;
    for (int j = 0; j < KEY_TILE; j++) {
        float p = j < valid ? vector_exp(s[j] - tile_top) : 0.f;
        if (pb) {
            pb[j] = float_to_bf16(p);
            p = bf16_to_float(pb[j]);
        }
        s[j] = p;
        sum += p;
    }
    *total = *total * *rescale + sum;
}

#if BF16_DOT
/* bfloat16 pairs, as vdpbf16ps takes them: a 32-bit lane holds elements 2i (low half) and 2i + 1. */
static inline __m512bh pairs(__m512i v) { return (__m512bh)v; }

/* The tile's keys (bfloat16, their slots in slot_of; zeros from n on) into kt as pairs of dimensions,
 * [dim / 2][KEY_TILE], and its values into vp as pairs of keys, [KEY_TILE / 2][dim]. dim: a multiple of 32. */
static void load_tile_pairs(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *slot_of, int n,
                            long head_base, int dim, uint32_t *kt, uint32_t *vp) {
    for (int j = 0; j < KEY_TILE; j++) {
        const uint32_t *k = j < n ? (const uint32_t *)(k_cache + (head_base + slot_of[j]) * dim) : NULL;
        for (int d2 = 0; d2 < dim / 2; d2++) kt[(long)d2 * KEY_TILE + j] = k ? k[d2] : 0;
    }
    /* element 2i of the low result is a's i, 2i + 1 is b's i; the high result the same from i = 16 */
    static const uint16_t low[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    __m512i to_low = _mm512_loadu_si512(low), to_high = _mm512_add_epi16(to_low, _mm512_set1_epi16(16));
    for (int j = 0; j < KEY_TILE; j += 2) {
        const uint16_t *a = j < n ? v_cache + (head_base + slot_of[j]) * dim : NULL;
        const uint16_t *b = j + 1 < n ? v_cache + (head_base + slot_of[j + 1]) * dim : NULL;
        uint32_t *row = vp + (long)(j / 2) * dim;
        for (int d = 0; d < dim; d += 32) {
            __m512i va = a ? _mm512_loadu_si512(a + d) : _mm512_setzero_si512();
            __m512i vb = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(row + d, _mm512_permutex2var_epi16(va, to_low, vb));
            _mm512_storeu_si512(row + d + 16, _mm512_permutex2var_epi16(va, to_high, vb));
        }
    }
}

/* scores[r][0..KEY_TILE) = scale * q[r] . k[j] for rows r0 .. r0 + ROW_BLOCK - 1 (q as pairs of dimensions,
 * [rows][dim / 2]). */
static void block_scores_dot(const uint32_t *q, const uint32_t *kt, float *scores, int r0, int dim, float scale) {
    __m512 s[ROW_BLOCK][4];
    for (int b = 0; b < ROW_BLOCK; b++)
        for (int c = 0; c < 4; c++) s[b][c] = _mm512_setzero_ps();
    for (int d2 = 0; d2 < dim / 2; d2++) {
        const uint32_t *kd = kt + (long)d2 * KEY_TILE;
        __m512bh k0 = pairs(_mm512_loadu_si512(kd)), k1 = pairs(_mm512_loadu_si512(kd + 16));
        __m512bh k2 = pairs(_mm512_loadu_si512(kd + 32)), k3 = pairs(_mm512_loadu_si512(kd + 48));
        for (int b = 0; b < ROW_BLOCK; b++) {
            __m512bh qd = pairs(_mm512_set1_epi32((int)q[(long)(r0 + b) * (dim / 2) + d2]));
            s[b][0] = _mm512_dpbf16_ps(s[b][0], qd, k0); s[b][1] = _mm512_dpbf16_ps(s[b][1], qd, k1);
            s[b][2] = _mm512_dpbf16_ps(s[b][2], qd, k2); s[b][3] = _mm512_dpbf16_ps(s[b][3], qd, k3);
        }
    }
    __m512 by = _mm512_set1_ps(scale);
    for (int b = 0; b < ROW_BLOCK; b++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(scores + (long)(r0 + b) * KEY_TILE + 16 * c, _mm512_mul_ps(s[b][c], by));
}

/* acc[r] = acc[r] * rescale[r] + sum_j p[r][j] v[j] for rows r0 .. r0 + ROW_BLOCK - 1 over keys 0 .. n - 1,
 * p as pairs of keys ([rows][KEY_TILE / 2]): the head dimension 64 at a time, then 16 at a time. */
static void block_values_dot(const uint32_t *p, const uint32_t *vp, const float *rescale, float *acc, int r0, int n,
                             int dim) {
    int key_pairs = (n + 1) / 2, c0 = 0;
    for (; c0 < dim; c0 += 64) {
        int vectors = dim - c0 >= 64 ? 4 : (dim - c0) / 16;
        __m512 a[ROW_BLOCK][4];
        for (int b = 0; b < ROW_BLOCK; b++)
            for (int c = 0; c < vectors; c++)
                a[b][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (long)(r0 + b) * dim + c0 + 16 * c),
                                        _mm512_set1_ps(rescale[r0 + b]));
        for (int j2 = 0; j2 < key_pairs; j2++) {
            const uint32_t *vj = vp + (long)j2 * dim + c0;
            for (int c = 0; c < vectors; c++) {
                __m512bh v = pairs(_mm512_loadu_si512(vj + 16 * c));
                for (int b = 0; b < ROW_BLOCK; b++)
                    a[b][c] = _mm512_dpbf16_ps(a[b][c], pairs(_mm512_set1_epi32((int)p[(long)(r0 + b) * (KEY_TILE / 2) + j2])), v);
            }
        }
        for (int b = 0; b < ROW_BLOCK; b++)
            for (int c = 0; c < vectors; c++) _mm512_storeu_ps(acc + (long)(r0 + b) * dim + c0 + 16 * c, a[b][c]);
    }
}
#endif

/* q: rows of the step, q_stride elements apart, each [heads, dim]; out: [rows, heads, dim]. Sequence i owns
 * step rows query_start[i] .. + query_len[i] - 1, and slot_map[slot_offsets[i] .. slot_offsets[i + 1] - 1]
 * are its context's slots in position order (context_len = their count). scratch holds threads times
 * prefill_attention_scratch floats. Returns 0, or -1 for shapes it does not handle (head_dim must be a
 * multiple of 16). */
int prefill_attention(int bf16, const void *q, long q_stride, const void *k_cache, const void *v_cache, void *out,
                      int num_seqs, const int64_t *query_start, const int64_t *query_len, const int64_t *slot_map,
                      const int64_t *slot_offsets, int heads, int kv_heads, int dim, long slots, float scale,
                      float *scratch, int threads) {
    int group = heads / kv_heads;
    if (group < 1 || group > MAX_GROUP || heads % kv_heads || dim < 16 || dim > MAX_DIM || dim % 16
        || num_seqs < 0 || num_seqs > MAX_SEQS) return -1;
    int positions = tile_positions(group);
    long per_thread = prefill_attention_scratch(group, dim), padded = padded_rows(group);
    int dot = BF16_DOT && bf16 && dim % 32 == 0;  /* the bfloat16 products take 32 dimensions a vector */
    long first_item[MAX_SEQS + 1];
    first_item[0] = 0;
    for (int i = 0; i < num_seqs; i++) {
        long context = slot_offsets[i + 1] - slot_offsets[i];
        if (query_len[i] < 1 || query_len[i] > context) return -1;
        first_item[i + 1] = first_item[i] + (long)kv_heads * ((query_len[i] + positions - 1) / positions);
    }
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long item = 0; item < first_item[num_seqs]; item++) {
        int seq = 0;
        while (first_item[seq + 1] <= item) seq++;
        long tiles = (query_len[seq] + positions - 1) / positions;
        long local = item - first_item[seq];
        int kh = (int)(local / tiles);
        long t0 = (local % tiles) * positions;
        long t1 = t0 + positions < query_len[seq] ? t0 + positions : query_len[seq];
        const int64_t *slot_of = slot_map + slot_offsets[seq];
        long past = slot_offsets[seq + 1] - slot_offsets[seq] - query_len[seq];
        int rows = (int)(t1 - t0) * group;  /* row r: position t0 + r / group, head kh * group + r % group */
        int blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
        float *qf = scratch + (long)omp_get_thread_num() * per_thread;
        float *acc = qf + padded * dim;
        float *scores = acc + padded * dim;
        float *kt = scores + padded * KEY_TILE;  /* [dim][KEY_TILE] */
        float *vf = kt + (long)KEY_TILE * dim;    /* [KEY_TILE][dim] */
        float *top = vf + (long)KEY_TILE * dim, *total = top + padded, *rescale = total + padded;
        /* with the bfloat16 products: q's rows as they are ([rows][dim] bfloat16), the probabilities pb */
        uint16_t *pb = dot ? (uint16_t *)(rescale + padded) : NULL;
        for (int r = 0; r < blocks; r++) {
            float *qr = qf + (long)r * dim;
            long row = query_start[seq] + t0 + r / group, head = (long)kh * group + r % group;
            if (dot) {
                uint16_t *qb = (uint16_t *)qf + (long)r * dim;
                if (r < rows) memcpy(qb, (const uint16_t *)q + row * q_stride + head * dim, dim * sizeof(uint16_t));
                else memset(qb, 0, dim * sizeof(uint16_t));
            } else if (r < rows) {
                load_row(bf16, q, row * q_stride + head * dim, dim, qr);
                for (int d = 0; d < dim; d++) qr[d] *= scale;
            } else {
                memset(qr, 0, dim * sizeof(float));
            }
            memset(acc + (long)r * dim, 0, dim * sizeof(float));
            top[r] = -FLT_MAX;
            total[r] = 0.f;
        }
        long keys = past + t1;  /* the last row's position + 1 */
        for (long k0 = 0; k0 < keys; k0 += KEY_TILE) {
            int n = keys - k0 < KEY_TILE ? (int)(keys - k0) : KEY_TILE;
#if BF16_DOT
            if (dot) {
                load_tile_pairs(k_cache, v_cache, slot_of + k0, n, (long)kh * slots, dim, (uint32_t *)kt,
                                (uint32_t *)vf);
                for (int r0 = 0; r0 < blocks; r0 += ROW_BLOCK)
                    block_scores_dot((const uint32_t *)qf, (const uint32_t *)kt, scores, r0, dim, scale);
            }
#endif
            if (!dot) {
                load_tile(bf16, k_cache, v_cache, slot_of + k0, n, (long)kh * slots, dim, kt, vf);
                for (int r0 = 0; r0 < blocks; r0 += ROW_BLOCK) block_scores(qf, kt, scores, r0, dim);
            }
            for (int r = 0; r < blocks; r++) {
                long position = past + t0 + r / group;
                int valid = r >= rows ? 0 : position - k0 + 1 < n ? (int)(position - k0 + 1) : n;
                tile_softmax(scores + (long)r * KEY_TILE, valid, top + r, total + r, rescale + r,
                             pb ? pb + (long)r * KEY_TILE : NULL);
            }
#if BF16_DOT
            if (dot)
                for (int r0 = 0; r0 < blocks; r0 += ROW_BLOCK)
                    block_values_dot((const uint32_t *)pb, (const uint32_t *)vf, rescale, acc, r0, n, dim);
#endif
            if (!dot)
                for (int r0 = 0; r0 < blocks; r0 += ROW_BLOCK) block_values(scores, vf, rescale, acc, r0, n, dim);
        }
        for (int r = 0; r < rows; r++) {
            long o = ((query_start[seq] + t0 + r / group) * heads + (long)kh * group + r % group) * dim;
            float inv = 1.f / total[r];
            for (int d = 0; d < dim; d++) {
                float v = acc[(long)r * dim + d] * inv;
                if (bf16) ((uint16_t *)out)[o + d] = float_to_bf16(v);
                else ((float *)out)[o + d] = v;
            }
        }
    }
    return 0;
}
