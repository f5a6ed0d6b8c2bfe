/* A step of decodes through a run of Llama-family decoder layers in one parallel region
 * (engine/decode_layers.py builds and calls it), for bfloat16 on a CPU.
 *
 * Why: under the passive wait that `halfmoon up` sets, every parallel region wakes the other threads
 * through the kernel, and a decode step made five a layer (the projections, the attention): about 150
 * wake-ups, a third of the step on a 2-core machine. Here the threads wake once a step and meet at
 * barriers that spin a few microseconds before they sleep: on a quiet machine the other thread arrives
 * within the spin, and beside a busy process a thread whose partner lost its core sleeps soon and gives
 * its own core up.
 *
 * Each layer is what the engine's separate kernels compute, with the same code (layer_math.h,
 * linear_tiles.h, attend.h), so every row rounds the same on either path: RMSNorm, the fused QKV
 * projection, the rotary embedding of the query and key heads, the store of K and V into the paged cache,
 * attention over each sequence's spans, the output projection, the residual add and RMSNorm, the fused
 * gate-up projection, SiLU-and-multiply, the down projection and the residual add. Each thread keeps
 * its own copy of the residual stream and of the normalized rows (a few rows: cheaper to compute twice
 * than to meet for); the projections split their pairs of output blocks, the attention its (sequence,
 * KV head) pairs. */
#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "attend.h"
#include "layer_math.h"
#include "linear_tiles.h"

/* How long a thread at a barrier spins before it sleeps. A quiet machine's partner arrives within a few
 * microseconds; one that lost its core to another process comes back after milliseconds, and spinning for
 * it keeps a core from it. Of 5, 20 and 100 us, 5 kept nearly all of the quiet gain and was fastest beside
 * a busy loop (docs/BENCHMARKS.md, "A decode step in one parallel region"). */
#define SPIN_NS 5000

typedef struct {
    atomic_int arrived, generation, sleepers;
} Barrier;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void barrier_wait(Barrier *b, int team) {
    if (team == 1) return;
    int generation = atomic_load(&b->generation);
    if (atomic_fetch_add(&b->arrived, 1) == team - 1) {
        atomic_store(&b->arrived, 0);
        atomic_fetch_add(&b->generation, 1);
        if (atomic_load(&b->sleepers))
            syscall(SYS_futex, &b->generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
        return;
    }
    long deadline = now_ns() + SPIN_NS;
    for (int i = 1; atomic_load_explicit(&b->generation, memory_order_acquire) == generation; i++) {
        if (!(i & 63) && now_ns() > deadline) break;
        relax();
    }
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->generation) == generation)
        syscall(SYS_futex, &b->generation, FUTEX_WAIT_PRIVATE, generation, NULL, NULL, 0);
    atomic_fetch_sub(&b->sleepers, 1);
}

/* One layer's weights (packed for linear_tiles.h; biases [outputs] or NULL) and its caches. */
typedef struct {
    const uint16_t *input_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *gate_up_bias, *down, *down_bias;
    float input_eps, post_eps;
    uint16_t *k_cache, *v_cache; /* [kv_heads, cache_slots, head_dim] */
} Layer;

/* The model's shape. */
typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate;
    long cache_slots;
    float scale;
} Shape;

/* hidden [rows, shape.hidden]: the input of layers[0] in, the output of layers[count - 1] out. Row r is a decode
 * at cache slot slots[r] with cos and sin [rows, head_dim] for its position, attending the spans
 * span_offsets[r] .. span_offsets[r + 1] - 1 of spans (start, end slot pairs, its new slot among them).
 * Returns 0, -1 for a shape attend.h does not take, -2 where memory runs out. */
int decode_layers(const Layer *layers, int count, const Shape *shape, uint16_t *hidden, int rows, const uint16_t *cos,
                  const uint16_t *sin, const int64_t *slots, const int64_t *spans, const int64_t *span_offsets,
                  int threads) {
    const int heads = shape->heads, kv_heads = shape->kv_heads, dim = shape->head_dim, group = heads / kv_heads;
    const long width = shape->hidden, inter = shape->intermediate, qkv_n = (long)(heads + 2 * kv_heads) * dim;
    if (!attend_takes(heads, kv_heads, dim)) return -1;
    if (threads < 1) threads = 1;
    /* shared: the projections' outputs; each thread's own: residual, normalized rows, activation */
    const long shared = rows * (qkv_n + (long)heads * dim + 2 * width + 2 * inter), own = rows * (2 * width + inter);
    uint16_t *memory = malloc((size_t)(shared + own * threads) * sizeof(uint16_t));
    if (!memory) return -2;
    uint16_t *qkv = memory, *attention = qkv + rows * qkv_n, *o_out = attention + (long)rows * heads * dim;
    uint16_t *gate_up = o_out + rows * width, *down_out = gate_up + rows * 2 * inter;
    Barrier barrier = {0, 0, 0};
    #pragma omp parallel num_threads(threads)
    {
        const int team = omp_get_num_threads(), me = omp_get_thread_num();
        uint16_t *residual = memory + shared + own * me, *normed = residual + rows * width;
        uint16_t *act = normed + rows * width;
        const long units = (long)rows * kv_heads, unit_from = units * me / team, unit_to = units * (me + 1) / team;
        memcpy(residual, hidden, (size_t)rows * width * sizeof(uint16_t));
        for (long r = 0; r < rows; r++)
            rms_norm_row(residual + r * width, NULL, NULL, layers[0].input_norm, normed + r * width, (int)width,
                         layers[0].input_eps);
        for (int l = 0; l < count; l++) {
            const Layer *layer = &layers[l];
            long groups = linear_group_count(qkv_n);
            linear_groups(normed, rows, width, layer->qkv, qkv_n, layer->qkv_bias, qkv, groups * me / team,
                          groups * (me + 1) / team);
            barrier_wait(&barrier, team);
            Call call = {1, qkv, layer->k_cache, layer->v_cache, attention, qkv_n, heads, shape->cache_slots, spans,
                         span_offsets, shape->scale};
            for (long u = unit_from; u < unit_to; u++) {
                int b = (int)(u / kv_heads), kh = (int)(u % kv_heads);
                uint16_t *row = qkv + b * qkv_n;
                const uint16_t *c = cos + (long)b * dim, *s = sin + (long)b * dim;
                for (int g = 0; g < group; g++) rotary_head(row + (long)(kh * group + g) * dim, c, s, dim);
                uint16_t *k = row + (long)(heads + kh) * dim, *v = row + (long)(heads + kv_heads + kh) * dim;
                rotary_head(k, c, s, dim);
                long at = ((long)kh * shape->cache_slots + slots[b]) * dim;
                memcpy(layer->k_cache + at, k, (size_t)dim * sizeof(uint16_t));
                memcpy(layer->v_cache + at, v, (size_t)dim * sizeof(uint16_t));
                attend_unit(&call, b, kh, dim, group);
            }
            barrier_wait(&barrier, team);
            groups = linear_group_count(width);
            linear_groups(attention, rows, (long)heads * dim, layer->o, width, layer->o_bias, o_out,
                          groups * me / team, groups * (me + 1) / team);
            barrier_wait(&barrier, team);
            for (long r = 0; r < rows; r++)
                rms_norm_row(o_out + r * width, residual + r * width, residual + r * width, layer->post_norm,
                             normed + r * width, (int)width, layer->post_eps);
            groups = linear_group_count(2 * inter);
            linear_groups(normed, rows, width, layer->gate_up, 2 * inter, layer->gate_up_bias, gate_up,
                          groups * me / team, groups * (me + 1) / team);
            barrier_wait(&barrier, team);
            for (long r = 0; r < rows; r++) silu_mul_row(gate_up + r * 2 * inter, act + r * inter, inter);
            groups = linear_group_count(width);
            linear_groups(act, rows, inter, layer->down, width, layer->down_bias, down_out, groups * me / team,
                          groups * (me + 1) / team);
            barrier_wait(&barrier, team);
            if (l + 1 < count) {
                for (long r = 0; r < rows; r++)
                    rms_norm_row(down_out + r * width, residual + r * width, residual + r * width,
                                 layers[l + 1].input_norm, normed + r * width, (int)width, layers[l + 1].input_eps);
            } else {
                for (long r = rows * me / team; r < rows * (me + 1) / team; r++)
                    for (long d = 0; d < width; d++)
                        hidden[r * width + d] = float_to_bf16(bf16_to_float(residual[r * width + d])
                                                              + bf16_to_float(down_out[r * width + d]));
            }
        }
    }
    free(memory);
    return 0;
}
