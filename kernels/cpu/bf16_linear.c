/* Linear layers of fp32 models whose weights are stored as bf16 (AVX2 + FMA):
 *
 *   out[M, N] = x[M, K] . W[N, K]^T (+ bias[N]) (+ residual[M, N])     x, out fp32
 *
 * A decode step reads every weight once for a few rows of x, so it is bound by the
 * weights' bytes. On CPUs without native bf16 the model computes in fp32; storing its
 * weights in bf16 (the checkpoint's own dtype) halves what a step reads. The widening
 * costs nothing: a bf16 value is the top half of an fp32 one, so interleaving 16-bit
 * zeros below each weight (one unpack per 8) gives the fp32 value exactly.
 *
 * Packed layout: 16-column blocks, K sequential inside a block, 16 values per k:
 *
 *   packed[(nb * K + k) * 16 + p] = W[16 nb + COLUMN_OF[p]][k]      (0 past row N)
 *
 * COLUMN_OF swaps the middle two groups of four because unpacklo/unpackhi work per
 * 128-bit lane: unpacklo then yields columns 0-7 and unpackhi columns 8-15.
 *
 * Every output is one fp32 sum over k in ascending order (one FMA per k), then + bias,
 * then + residual. Nothing in that order depends on M, on the row's place among the
 * rows, or on the thread that computes it: a row's output is bit-identical whatever
 * else is in the step. Arguments are checked by the Python wrapper
 * (kernels/cpu/bf16_linear.py).
 */

#include <stdint.h>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>
#define CHATSVC_BF16_LINEAR 1
#endif

enum { COLS = 16, ROWS = 6 };

/* Bytes of weights a thread keeps in its L2 while every row tile passes over them. */
enum { CHUNK_BYTES = 256 * 1024 };

static const int COLUMN_OF[COLS] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

/* bf16 elements of W [n, k] once packed. */
int64_t chatsvc_bf16_linear_packed_elements(int64_t n, int64_t k) {
    return (n + COLS - 1) / COLS * COLS * k;
}

/* Pack W [n, k] (bf16, rows `w_stride` elements apart) into `packed`. */
void chatsvc_bf16_linear_pack(const uint16_t *w, int64_t w_stride, int64_t n, int64_t k,
                              uint16_t *packed) {
    const int64_t nbs = (n + COLS - 1) / COLS;
    for (int64_t nb = 0; nb < nbs; nb++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int p = 0; p < COLS; p++) {
                const int64_t row = nb * COLS + COLUMN_OF[p];
                packed[(nb * k + kk) * COLS + p] = row < n ? w[row * w_stride + kk] : 0;
            }
}

#if defined(CHATSVC_BF16_LINEAR)
/* Rows [0, rows) of x (rows <= ROWS) against one column block: out's columns
 * [col0, col0 + 16). `rows` is a constant in each caller, so the loops over it unroll
 * and the accumulators stay in registers (12 of the 16). */
static inline __attribute__((always_inline)) void row_tile(
    const int rows, const float *x, int64_t x_stride, const uint16_t *block, int64_t k,
    int64_t col0, int64_t n, const float *bias, const float *residual, int64_t residual_stride,
    float *out, int64_t out_stride) {
    const __m256i zero = _mm256_setzero_si256();
    /* Named accumulators, not an array: gcc spills an array to the stack every k. */
#define ZERO(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
#define FMA(r)                                                           \
    if (rows > r) {                                                      \
        const __m256 xb = _mm256_broadcast_ss(x + r * x_stride + kk);    \
        a##r##0 = _mm256_fmadd_ps(xb, lo, a##r##0);                      \
        a##r##1 = _mm256_fmadd_ps(xb, hi, a##r##1);                      \
    }
    ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5)
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(block + kk * COLS));
        const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w));
        const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w));
        FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5)
    }
#undef ZERO
#undef FMA
    const __m256 acc[ROWS][2] = {{a00, a01}, {a10, a11}, {a20, a21},
                                 {a30, a31}, {a40, a41}, {a50, a51}};
    const int64_t live = n - col0 < COLS ? n - col0 : COLS;
    if (live == COLS) {
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
        if (bias) b0 = _mm256_loadu_ps(bias + col0), b1 = _mm256_loadu_ps(bias + col0 + 8);
        for (int r = 0; r < rows; r++) {
            __m256 v0 = acc[r][0], v1 = acc[r][1];
            if (bias) v0 = _mm256_add_ps(v0, b0), v1 = _mm256_add_ps(v1, b1);
            if (residual) {
                const float *res = residual + r * residual_stride + col0;
                v0 = _mm256_add_ps(v0, _mm256_loadu_ps(res));
                v1 = _mm256_add_ps(v1, _mm256_loadu_ps(res + 8));
            }
            _mm256_storeu_ps(out + r * out_stride + col0, v0);
            _mm256_storeu_ps(out + r * out_stride + col0 + 8, v1);
        }
        return;
    }
    /* The last, partial block: the same sums, written column by column. */
    float sums[2 * 8] __attribute__((aligned(32)));
    for (int r = 0; r < rows; r++) {
        _mm256_store_ps(sums, acc[r][0]);
        _mm256_store_ps(sums + 8, acc[r][1]);
        for (int64_t c = 0; c < live; c++) {
            float v = sums[c];
            if (bias) v += bias[col0 + c];
            if (residual) v += residual[r * residual_stride + col0 + c];
            out[r * out_stride + col0 + c] = v;
        }
    }
}

static void rows_at(int rows, const float *x, int64_t x_stride, const uint16_t *block, int64_t k,
                    int64_t col0, int64_t n, const float *bias, const float *residual,
                    int64_t residual_stride, float *out, int64_t out_stride) {
#define ROW_TILE(R) \
    row_tile(R, x, x_stride, block, k, col0, n, bias, residual, residual_stride, out, out_stride)
    switch (rows) {
        case 1: ROW_TILE(1); break;
        case 2: ROW_TILE(2); break;
        case 3: ROW_TILE(3); break;
        case 4: ROW_TILE(4); break;
        case 5: ROW_TILE(5); break;
        default: ROW_TILE(6); break;
    }
#undef ROW_TILE
}

/* Column blocks [first, last) of out, all m rows: a chunk of blocks at a time, every
 * row tile over the chunk, so the chunk's weights come from memory once and from L2
 * for the later row tiles. */
static void linear_blocks(const float *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                          int64_t n, int64_t k, int64_t first, int64_t last, const float *bias,
                          const float *residual, int64_t residual_stride, float *out,
                          int64_t out_stride) {
    int64_t chunk = CHUNK_BYTES / (k * COLS * 2);
    if (chunk < 1) chunk = 1;
    for (int64_t start = first; start < last; start += chunk) {
        const int64_t stop = start + chunk < last ? start + chunk : last;
        for (int64_t row0 = 0; row0 < m; row0 += ROWS) {
            const int rows = m - row0 < ROWS ? (int)(m - row0) : ROWS;
            for (int64_t nb = start; nb < stop; nb++)
                rows_at(rows, x + row0 * x_stride, x_stride, packed + nb * k * COLS, k,
                        nb * COLS, n, bias, residual ? residual + row0 * residual_stride : 0,
                        residual_stride, out + row0 * out_stride, out_stride);
        }
    }
}
#endif

/* out = x . W^T (+ bias) (+ residual): x, bias, residual and out fp32, W packed by
 * `chatsvc_bf16_linear_pack`. bias and residual may be NULL. Returns 0, or -1 where
 * this build has no AVX2 + FMA (nothing is written then). */
int chatsvc_bf16_linear(const float *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                        int64_t n, int64_t k, const float *bias, const float *residual,
                        int64_t residual_stride, float *out, int64_t out_stride,
                        int32_t num_threads) {
#if defined(CHATSVC_BF16_LINEAR)
    if (m <= 0 || n <= 0) return 0;
    const int64_t nbs = (n + COLS - 1) / COLS;
    /* A second thread pays for its wake-up only with enough columns to share (as the
     * tile linears: every matrix of the models served here has 36 or more blocks). */
    const int threads = nbs >= 8 ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        linear_blocks(x, x_stride, m, packed, n, k, nbs * t / team, nbs * (t + 1) / team, bias,
                      residual, residual_stride, out, out_stride);
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)packed, (void)n, (void)k, (void)bias;
    (void)residual, (void)residual_stride, (void)out, (void)out_stride, (void)num_threads;
    return -1;
#endif
}

/* 1 where `chatsvc_bf16_linear` runs (a build for a CPU with AVX2 and FMA), else 0. */
int chatsvc_bf16_linear_available(void) {
#if defined(CHATSVC_BF16_LINEAR)
    return 1;
#else
    return 0;
#endif
}
