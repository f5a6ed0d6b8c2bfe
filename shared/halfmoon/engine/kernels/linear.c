/* A projection of bfloat16 rows by a bfloat16 weight, y = x W^T (+ bias), float32 sums rounded once to
 * bfloat16 (engine/weights.py packs the weight and calls it). Each output sums its products in the order of
 * the input pairs, whatever rows share the call: a row rounds the same in a decode step of eight rows and
 * in a prompt chunk of five hundred.
 *
 * The weight is packed as [blocks of 16 outputs][input pairs][16][2]: one 512-bit vector holds an input
 * pair for 16 outputs, the operand vdpbf16ps takes (AVX512-BF16), with each row's pair broadcast beside
 * it. A tile of up to 8 rows by two blocks keeps 16 vectors of sums in registers, so a decode step reads
 * each weight once, in order, and a prompt's rows load one broadcast per two products. Outputs past the
 * weight's rows are padded with zeros in the packing and not stored. Each thread takes its own pairs of
 * blocks over every row, on the OpenMP runtime torch has loaded (libgomp.so.1). The arithmetic is
 * linear_tiles.h's. */
#include <omp.h>
#include <stdint.h>

#include "linear_tiles.h"

/* y [rows, n] bfloat16 = x [rows, k] (contiguous, k even) times the packed weight of n outputs, plus bias
 * ([n] bfloat16, or NULL) in float32 before the rounding. */
void linear(const uint16_t *x, long rows, long k, const uint16_t *packed, long n, const uint16_t *bias,
            uint16_t *y, int threads) {
    long groups = linear_group_count(n), tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    #pragma omp parallel num_threads(threads) if (groups * tiles > 1)
    {
        /* each thread its own pairs of blocks, no barrier between chunks: with a passive wait policy every
         * barrier is a wake-up, and 32 of them a call cost a 2,048-row call a tenth of its time */
        int team = omp_get_num_threads(), me = omp_get_thread_num();
        linear_groups(x, rows, k, packed, n, bias, y, groups * me / team, groups * (me + 1) / team);
    }
}
