/* The element-wise layers of a decoder step on the CPU: RMSNorm, RoPE, SwiGLU.
 *
 * Inside a step torch spends far more per call on each of these for a few dozen
 * rows than the arithmetic takes (dtype casts, temporaries, dispatch, a parallel
 * region), several calls per layer; these loops spend little besides it (figures
 * in docs/kernels.md, "Element-wise layers"). Arithmetic is fp32; bf16 results are
 * rounded where torch's own ops round, so the two paths agree to the last bit
 * or one bf16 step. Rows are split across the caller's OpenMP team only when
 * there is enough work to pay for waking it. Arguments are checked by the
 * Python wrappers (kernels/rms_norm.py, kernels/rope.py, kernels/swiglu.py).
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "exports.h"

/* Work (elements) from which a call splits its rows across the team: below it the
 * wake-up costs more than the second core gives. */
enum { PARALLEL_ELEMENTS = 32768 };

static inline float load_value(const void *base, int64_t i, int32_t dtype) {
    return dtype == DTYPE_F32 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

/* What a bf16 tensor would hold after an op that rounds (fp32: unchanged). */
static inline float rounded(float x, int32_t dtype) {
    return dtype == DTYPE_F32 ? x : bf16_to_f32(f32_to_bf16(x));
}

static inline void store_value(void *base, int64_t i, float x, int32_t dtype) {
    if (dtype == DTYPE_F32)
        ((float *)base)[i] = x;
    else
        ((uint16_t *)base)[i] = f32_to_bf16(x);
}

/* RMSNorm: out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, rounded once (as torch's
 * fused kernel). x and out: rows of `hidden` elements `x_stride` / `out_stride` apart;
 * dtype 0 fp32, 1 bf16. */
void chatsvc_rms_norm(const void *x, int64_t x_stride, const void *weight, void *out,
                      int64_t out_stride, int64_t rows, int64_t hidden, float eps, int32_t dtype,
                      int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        float sum = 0.0f;
        if (dtype == DTYPE_F32) {
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
            for (int64_t i = 0; i < hidden; i++) sum += bf16_to_f32(row[i]) * bf16_to_f32(row[i]);
            const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++)
                dst[i] = f32_to_bf16(bf16_to_f32(row[i]) * inv * bf16_to_f32(w[i]));
        }
    }
}

/* RoPE in place, HF's rotate_half layout: for each head of x[t] (heads `head_stride`
 * apart, rows `row_stride` apart), with c = cos[t], s = sin[t] (rows of head_dim,
 * both halves equal):
 *     x[:h] <- x[:h] * c - x[h:] * s,   x[h:] <- x[h:] * c + x[:h] * s   (h = head_dim / 2)
 * rounded as torch's x.mul_(cos).addcmul_(rotate_half(x), sin) rounds. */
static inline __attribute__((always_inline)) void rope_head(void *x, int64_t base,
                                                            int64_t half, const void *cos,
                                                            const void *sin, int64_t table,
                                                            const int32_t dtype) {
#pragma omp simd
    for (int64_t i = 0; i < half; i++) {
        const float c = load_value(cos, table + i, dtype);
        const float s = load_value(sin, table + i, dtype);
        const float lo = load_value(x, base + i, dtype);
        const float hi = load_value(x, base + half + i, dtype);
        const float lo_c = rounded(lo * c, dtype), hi_c = rounded(hi * c, dtype);
        store_value(x, base + i, lo_c - hi * s, dtype);
        store_value(x, base + half + i, hi_c + lo * s, dtype);
    }
}

void chatsvc_rope(void *x, int64_t row_stride, int64_t head_stride, int64_t rows,
                  int64_t heads, int64_t head_dim, const void *cos, const void *sin,
                  int32_t dtype, int32_t num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) \
    if (rows * heads * head_dim >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t base = t * row_stride + h * head_stride;
            if (dtype == DTYPE_F32)
                rope_head(x, base, half, cos, sin, t * head_dim, 0);
            else
                rope_head(x, base, half, cos, sin, t * head_dim, 1);
        }
    }
}

/* One row of SwiGLU; `dtype` is a literal at the call sites, so each copy vectorises
 * without per-element dtype tests. */
static inline __attribute__((always_inline)) void swiglu_row(const void *gate_up, void *out,
                                                             int64_t in_offset,
                                                             int64_t out_offset, int64_t inter,
                                                             const int32_t dtype) {
    const float log2e = 1.4426950408889634f;
#pragma omp simd
    for (int64_t i = 0; i < inter; i++) {
        const float g = load_value(gate_up, in_offset + i, dtype);
        const float u = load_value(gate_up, in_offset + inter + i, dtype);
        /* e = exp(-|g|) <= 1, so neither branch overflows. */
        const float e = exp2_nonpositive(-fabsf(g) * log2e);
        const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
        store_value(out, out_offset + i, rounded(g * sigmoid, dtype) * u, dtype);
    }
}

/* SwiGLU: out[t] = silu(gate) * up with [gate | up] = gate_up[t] (2 * inter elements);
 * silu is rounded before the product, as torch's F.silu(gate).mul_(up). */
void chatsvc_swiglu(const void *gate_up, int64_t in_stride, void *out, int64_t out_stride,
                    int64_t rows, int64_t inter, int32_t dtype, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) \
    if (rows * inter >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        if (dtype == DTYPE_F32)
            swiglu_row(gate_up, out, t * in_stride, t * out_stride, inter, 0);
        else
            swiglu_row(gate_up, out, t * in_stride, t * out_stride, inter, 1);
    }
}
