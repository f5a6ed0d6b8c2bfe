/* The projection's arithmetic (linear.c has the layout and contract): tiles of rows by blocks of 16
 * outputs, and a range of pairs of blocks over every row, the share of one thread. linear.c and
 * decode_layers.c both run it, so a row's outputs round the same on either path. */
#ifndef HALFMOON_LINEAR_TILES_H
#define HALFMOON_LINEAR_TILES_H
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

/* the sums' order is the contract: no reassociation, whatever the build's flags allow the other kernels */
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

#define BLOCK 16
#define TILE_ROWS 8
#define TILE_BLOCKS 2
/* how far ahead a tile of several rows asks for the weight: computing, it would not keep memory busy */
#define PREFETCH_PAIRS 32
#define CHUNK_TILES 8

/* sums[r][j * 16 + o] = output o of block j (``blocks`` of them, ``stride`` bfloat16 apart in w) for ``rows``
 * rows of x (``k`` bfloat16 apart). Inlined into each (rows, blocks) below, so the sums live in registers. */
static inline __attribute__((always_inline)) void tile(const int rows, const int blocks, const uint16_t *x, long k,
                                                       long pairs, const uint16_t *w, long stride,
                                                       float sums[][TILE_BLOCKS * BLOCK]) {
#ifdef __AVX512BF16__
    __m512 acc[TILE_ROWS][TILE_BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < blocks; j++)
            acc[r][j] = _mm512_setzero_ps();
    for (long p = 0; p < pairs; p++) {
        __m512bh wv[TILE_BLOCKS];
        for (int j = 0; j < blocks; j++) {
            const uint16_t *at = w + j * stride + p * 2 * BLOCK;
            if (rows > 1) /* one row streams the weight as fast as memory gives it: a prefetch only costs */
                _mm_prefetch((const char *)(at + PREFETCH_PAIRS * 2 * BLOCK), _MM_HINT_T0);
            wv[j] = (__m512bh)_mm512_loadu_si512(at);
        }
        for (int r = 0; r < rows; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * k + 2 * p, sizeof pair);
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int j = 0; j < blocks; j++)
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < blocks; j++)
            _mm512_storeu_ps(sums[r] + j * BLOCK, acc[r][j]);
#else
    /* the same sums without bfloat16 products: each pair's even input, then its odd one, as float32 FMAs */
    typedef float floats __attribute__((vector_size(BLOCK * sizeof(float))));
    typedef uint32_t words __attribute__((vector_size(BLOCK * sizeof(uint32_t))));
    floats acc[TILE_ROWS][TILE_BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < blocks; j++)
            acc[r][j] = (floats){0};
    for (long p = 0; p < pairs; p++) {
        floats even[TILE_BLOCKS], odd[TILE_BLOCKS];
        for (int j = 0; j < blocks; j++) {
            words wv, even_bits, odd_bits;
            memcpy(&wv, w + j * stride + p * 2 * BLOCK, sizeof wv);
            even_bits = wv << 16;
            odd_bits = wv & 0xFFFF0000u;
            memcpy(&even[j], &even_bits, sizeof even[j]);
            memcpy(&odd[j], &odd_bits, sizeof odd[j]);
        }
        for (int r = 0; r < rows; r++) {
            float x0 = bf16_to_float(x[r * k + 2 * p]), x1 = bf16_to_float(x[r * k + 2 * p + 1]);
            for (int j = 0; j < blocks; j++) {
                acc[r][j] += even[j] * x0;
                acc[r][j] += odd[j] * x1;
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < blocks; j++)
            memcpy(sums[r] + j * BLOCK, &acc[r][j], sizeof acc[r][j]);
#endif
}

typedef void (*tile_fn)(const uint16_t *, long, long, const uint16_t *, long, float[][TILE_BLOCKS * BLOCK]);
#define TILE_OF(R, B)                                                                                      \
    static void tile_##R##_##B(const uint16_t *x, long k, long pairs, const uint16_t *w, long stride,      \
                               float sums[][TILE_BLOCKS * BLOCK]) {                                        \
        tile(R, B, x, k, pairs, w, stride, sums);                                                          \
    }
#define TILES_OF(B) TILE_OF(1, B) TILE_OF(2, B) TILE_OF(3, B) TILE_OF(4, B) TILE_OF(5, B) TILE_OF(6, B)    \
    TILE_OF(7, B) TILE_OF(8, B)
TILES_OF(1)
TILES_OF(2)
static const tile_fn TILES[TILE_BLOCKS + 1][TILE_ROWS + 1] = {
    {0},
    {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1, tile_7_1, tile_8_1},
    {0, tile_1_2, tile_2_2, tile_3_2, tile_4_2, tile_5_2, tile_6_2, tile_7_2, tile_8_2},
};

/* Pairs of blocks ``from`` to ``to`` of y [rows, n] = x [rows, k] times the packed weight of n outputs (plus
 * bias, [n] or NULL, in float32 before the rounding), CHUNK_TILES tiles of rows at a time so that their rows
 * stay in cache while the weight streams past. */
static void linear_groups(const uint16_t *x, long rows, long k, const uint16_t *packed, long n, const uint16_t *bias,
                          uint16_t *y, long from, long to) {
    long pairs = k / 2, stride = pairs * 2 * BLOCK, blocks = (n + BLOCK - 1) / BLOCK;
    long tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    for (long chunk = 0; chunk < tiles; chunk += CHUNK_TILES) {
        long end = chunk + CHUNK_TILES < tiles ? chunk + CHUNK_TILES : tiles;
        for (long g = from; g < to; g++) {
            for (long t = chunk; t < end; t++) {
                long first = t * TILE_ROWS, block = g * TILE_BLOCKS;
                int count = rows - first < TILE_ROWS ? (int)(rows - first) : TILE_ROWS;
                int width = blocks - block < TILE_BLOCKS ? (int)(blocks - block) : TILE_BLOCKS;
                float sums[TILE_ROWS][TILE_BLOCKS * BLOCK];
                TILES[width][count](x + first * k, k, pairs, packed + block * stride, stride, sums);
                long outputs = n - block * BLOCK < width * BLOCK ? n - block * BLOCK : width * BLOCK;
                for (int r = 0; r < count; r++) {
                    uint16_t *out = y + (first + r) * n + block * BLOCK;
                    for (long o = 0; o < outputs; o++)
                        out[o] = float_to_bf16(sums[r][o] + (bias ? bf16_to_float(bias[block * BLOCK + o]) : 0.f));
                }
            }
        }
    }
}

/* The pairs of blocks of an n-output projection. */
static inline long linear_group_count(long n) { return ((n + BLOCK - 1) / BLOCK + TILE_BLOCKS - 1) / TILE_BLOCKS; }

#pragma GCC pop_options
#endif
