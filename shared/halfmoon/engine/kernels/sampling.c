/* The sampler's token choice for a step's rows in one pass each (engine/sampler.py builds the inputs and
 * keeps the same formula in PyTorch where this library is not loaded). Rows are spread over the OpenMP
 * runtime torch has loaded (libgomp.so.1, one pool). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_exp.h"

/* For each row r of float32 logits [rows, vocab] (contiguous):
 *   logprob[r]: the log-softmax of logits' row at token[r];
 *   token[r]: where temperature[r] is 0, the first largest logit. Else inverse-transform sampling over the
 *     weights exp((masked - max) / temperature), masked's row being logits' with the entries a filter dropped
 *     at -inf (masked NULL: logits itself): the first token whose running sum, in double, exceeds uniform[r]
 *     times the sum of all. A weight below exp's float range is 0, so such a token is never drawn. Where the
 *     weights have no finite positive sum, the first largest logit.
 * The weights are kept in a float per vocabulary entry and row, so they are computed once, vectorized.
 * Returns 0, or -1 where that memory could not be had (nothing is written then). */
int sample(const float *logits, const float *masked, long rows, long vocab, const double *temperature,
            const double *uniform, int64_t *token, float *logprob, int threads) {
    float *scratch = malloc(sizeof(float) * (size_t)rows * (size_t)vocab);
    if (!scratch)
        return -1;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows > 1)
    for (long r = 0; r < rows; r++) {
        const float *l = logits + r * vocab;
        float top = -FLT_MAX;
        long best = 0;
        for (long j = 0; j < vocab; j++)
            if (l[j] > top) { top = l[j]; best = j; }
        double total = 0.0;
        for (long j = 0; j < vocab; j++)
            total += vector_exp(l[j] - top);
        logprob[r] = l[best] - top - (float)log(total);
        long chosen = best;
        if (temperature[r] > 0.0) {
            /* under float's smallest normal the weights are the same (only the largest logits keep any),
             * where a temperature that rounds to 0 would divide 0 by 0 */
            float t = temperature[r] < FLT_MIN ? FLT_MIN : (float)temperature[r];
            const float *s = masked ? masked + r * vocab : l;
            float *w = scratch + r * vocab;
            float peak = -FLT_MAX;
            for (long j = 0; j < vocab; j++)
                peak = s[j] > peak ? s[j] : peak;
            double sum = 0.0;
            for (long j = 0; j < vocab; j++) {
                float x = (s[j] - peak) / t;
                float e = vector_exp(x);
                w[j] = x < -87.3f ? 0.f : e;
                sum += w[j];
            }
            if (isfinite(sum) && sum > 0.0) {
                double target = uniform[r] * sum, running = 0.0;
                long last = best;
                for (long j = 0; j < vocab; j++) {
                    if (w[j] <= 0.f) continue;
                    running += w[j];
                    last = j;
                    if (running > target) break;
                }
                chosen = last;
            }
        }
        token[r] = chosen;
        if (chosen != best)
            logprob[r] = l[chosen] - top - (float)log(total);
    }
    free(scratch);
    return 0;
}
