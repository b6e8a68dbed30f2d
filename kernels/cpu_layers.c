/* The element-wise layers of a decoder step on the CPU: RMSNorm, RoPE, SwiGLU.
 *
 * Inside a step torch spends 20-120 us per call on each of these for a few dozen
 * rows (dtype casts, temporaries, dispatch, a parallel region), several calls
 * per layer; these loops take a few. Arithmetic is fp32; bf16 results are
 * rounded where torch's own ops round, so the two paths agree to the last bit
 * or one bf16 step. Rows are split across the caller's OpenMP team only when
 * there is enough work to pay for waking it. Arguments are checked by the
 * Python wrappers (kernels/rms_norm.py, kernels/rope.py, kernels/swiglu.py).
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

/* Work (elements) from which a call splits its rows across the team: below it the
 * wake-up costs more than the second core gives. */
enum { PARALLEL_ELEMENTS = 32768 };

static inline float load_value(const void *base, int64_t i, int32_t dtype) {
    return dtype == 0 ? ((const float *)base)[i] : bf16_value(((const uint16_t *)base)[i]);
}

/* What a bf16 tensor would hold after an op that rounds (fp32: unchanged). */
static inline float rounded(float x, int32_t dtype) {
    return dtype == 0 ? x : bf16_value(bf16_round(x));
}

static inline void store_value(void *base, int64_t i, float x, int32_t dtype) {
    if (dtype == 0)
        ((float *)base)[i] = x;
    else
        ((uint16_t *)base)[i] = bf16_round(x);
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
            if (dtype == 0)
                rope_head(x, base, half, cos, sin, t * head_dim, 0);
            else
                rope_head(x, base, half, cos, sin, t * head_dim, 1);
        }
    }
}

/* 2^x for x <= 0 (clamped at -126), vectorisable: x = n + f, |f| <= 1/2, Taylor to degree 7. */
static inline float exp2_nonpositive(float x) {
    static const float taylor[8] = {
        1.5252733804059838e-05f, 1.5403530393381606e-04f, 1.3333558146428441e-03f,
        9.6181291076284772e-03f, 5.5504108664821576e-02f, 2.4022650695910071e-01f,
        6.9314718055994531e-01f, 1.0f,
    };
    x = x < -126.0f ? -126.0f : x;
    const float n = __builtin_floorf(x + 0.5f);
    const float f = x - n;
    float p = taylor[0];
    for (int c = 1; c < 8; c++) p = p * f + taylor[c];
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
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
        if (dtype == 0)
            swiglu_row(gate_up, out, t * in_stride, t * out_stride, inter, 0);
        else
            swiglu_row(gate_up, out, t * in_stride, t * out_stride, inter, 1);
    }
}
