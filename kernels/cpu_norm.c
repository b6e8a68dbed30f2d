/* RMSNorm on the CPU: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight.
 *
 * torch's rms_norm spends ~20-120 us per call on a few dozen rows (dtype casts,
 * temporaries, a parallel region), 61 calls per SmolLM2 step; this loop takes a
 * few. Sums and products are fp32 and the result is rounded once, as torch's
 * fused kernel does. Rows are split across the caller's OpenMP team only when
 * there are enough of them to pay for waking it. Arguments are checked by the
 * Python wrapper (kernels/rms_norm.py).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_value(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

enum { PARALLEL_ROWS = 64 };

/* x and out: rows of `hidden` elements `x_stride` / `out_stride` apart; dtype 0 fp32, 1 bf16. */
void chatsvc_rms_norm(const void *x, int64_t x_stride, const void *weight, void *out,
                      int64_t out_stride, int64_t rows, int64_t hidden, float eps, int32_t dtype,
                      int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= PARALLEL_ROWS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        float sum = 0.0f;
        if (dtype == 0) {
            const float *row = (const float *)x + t * x_stride;
            const float *w = (const float *)weight;
            float *dst = (float *)out + t * out_stride;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < hidden; i++) sum += row[i] * row[i];
            const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++) dst[i] = row[i] * inv * w[i];
        } else {
            const uint16_t *row = (const uint16_t *)x + t * x_stride;
            const uint16_t *w = (const uint16_t *)weight;
            uint16_t *dst = (uint16_t *)out + t * out_stride;
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < hidden; i++) sum += bf16_value(row[i]) * bf16_value(row[i]);
            const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++)
                dst[i] = bf16_round(bf16_value(row[i]) * inv * bf16_value(w[i]));
        }
    }
}
