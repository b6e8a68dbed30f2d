/* Linear layers of fp32 models whose weights are stored narrower (AVX2 + FMA; the row
 * tiles of narrow_linear_avx512.c where the CPU has AVX-512):
 *
 *   out[M, N] = x[M, K] . W[N, K]^T (+ bias[N]) (+ residual[M, N])     x, out fp32
 *
 * A decode step reads every weight once for a few rows of x, so it is bound by the
 * weights' bytes. On CPUs without native bf16 the model computes in fp32; its weights
 * stored in bf16 (the checkpoint's own dtype: nothing lost) halve what a step reads,
 * in int8 with a scale per output row they quarter it. Three formats:
 *
 *   bf16  W itself. A bf16 value is the top half of an fp32 one, so interleaving
 *         16-bit zeros below each weight (one unpack per 8) widens it exactly.
 *   int8  q[N, K] and scale[N], W ~ scale[n] * q[n][k] (symmetric, per output row:
 *         kernels/cpu/narrow_linear.py quantizes), summed against x quantized per group
 *         by integer dot products: narrow_int8.c, its own layout and sums.
 *   fp32  W itself, for weights bf16 does not hold exactly: the same sums in the same
 *         order as bf16's, so a row's output stays independent of its step.
 *
 * Packed layout of bf16 and fp32 (narrow_pack.c packs): 16-column blocks, K sequential
 * inside a block, 16 values per k:
 *
 *   packed[(nb * K + k) * 16 + p] = W[16 nb + COLUMN_OF[p]][k]      (0 past row N)
 *
 * For bf16 COLUMN_OF swaps the middle two groups of four, because unpacklo/unpackhi
 * work per 128-bit lane: unpacklo then yields columns 0-7 and unpackhi 8-15. For fp32
 * it is the identity.
 *
 * Every output is one fp32 sum over k in ascending order (one FMA per k), then + bias,
 * then + residual. Nothing in that order depends on M,
 * on the row's place among the rows, or on the thread that computes it: a row's output
 * is bit-identical whatever else is in the step. Arguments are checked by the Python
 * wrapper (kernels/cpu/narrow_linear.py).
 */

#include <stdint.h>

#include "exports.h"
#include "narrow_linear.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>
#define CHATSVC_NARROW_LINEAR 1
#endif

enum { ROWS = 6 };

#if defined(CHATSVC_NARROW_LINEAR)
/* The 16 weights of step kk of a block, widened to fp32: columns 0-7 in lo, 8-15 in hi. */
static inline __attribute__((always_inline)) void widen(const int format, const void *block,
                                                        int64_t kk, __m256 *lo, __m256 *hi) {
    if (format == FORMAT_BF16) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)((const uint16_t *)block + kk * COLS));
        const __m256i zero = _mm256_setzero_si256();
        *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w));
        *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w));
    } else { /* FORMAT_F32 */
        const float *w = (const float *)block + kk * COLS;
        *lo = _mm256_loadu_ps(w);
        *hi = _mm256_loadu_ps(w + 8);
    }
}

/* One finished sum of one row's 16 columns [col0, col0 + 16) (columns 0-7 in v0, 8-15
 * in v1): + bias, + residual, store; the last, partial block column by column. */
static inline __attribute__((always_inline)) void finish(
    __m256 v0, __m256 v1, int64_t col0, int64_t n, const float *bias, const float *residual,
    float *out) {
    const int64_t live = n - col0 < COLS ? n - col0 : COLS;
    if (live == COLS) {
        if (bias) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(bias + col0));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(bias + col0 + 8));
        }
        if (residual) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(residual + col0));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(residual + col0 + 8));
        }
        _mm256_storeu_ps(out + col0, v0);
        _mm256_storeu_ps(out + col0 + 8, v1);
        return;
    }
    float sums[2 * 8] __attribute__((aligned(32)));
    _mm256_store_ps(sums, v0);
    _mm256_store_ps(sums + 8, v1);
    for (int64_t c = 0; c < live; c++) {
        float v = sums[c];
        if (bias) v += bias[col0 + c];
        if (residual) v += residual[col0 + c];
        out[col0 + c] = v;
    }
}

/* Rows [0, rows) of x (rows <= ROWS) against one column block: out's columns
 * [col0, col0 + 16).
 * `rows` and `format` are constants in each caller, so the loops over rows unroll and
 * the accumulators stay in registers (12 of the 16). Where `has_next`, the block after
 * this one (the next in memory) is prefetched into L2 as fast as this one is read:
 * without it the tile waited on its loads from memory (docs/kernels.md). */
static inline __attribute__((always_inline)) void row_tile(
    const int rows, const int format, const float *x, int64_t x_stride, const void *block,
    int64_t k, int64_t col0, int64_t n, const float *bias,
    const float *residual, int64_t residual_stride, float *out, int64_t out_stride,
    int has_next) {
    /* Named accumulators, not an array: gcc spills an array to the stack every k. */
#define ZERO(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
#define FMA(r, at)                                                    \
    if (rows > r) {                                                   \
        const __m256 xb = _mm256_broadcast_ss(x + r * x_stride + at); \
        a##r##0 = _mm256_fmadd_ps(xb, lo, a##r##0);                   \
        a##r##1 = _mm256_fmadd_ps(xb, hi, a##r##1);                   \
    }
#define STEP(at)                                                    \
    {                                                               \
        __m256 lo, hi;                                              \
        widen(format, block, at, &lo, &hi);                         \
        FMA(0, at) FMA(1, at) FMA(2, at) FMA(3, at) FMA(4, at) FMA(5, at) \
    }
    ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5)
    const int64_t width = format_width(format), line_steps = 64 / (COLS * width);
    /* A prefetch never faults: without a next block the tile prefetches its own lines
     * again, so the loops carry no test for it. */
    const char *ahead = (const char *)block + (has_next ? k * COLS * width : 0);
    int64_t kk = 0;
    /* Below ROWS rows a turn of the loop takes a cache line of the block (line_steps
     * k) and prefetches one; the full tile's twelve accumulators leave no registers for
     * that (it ran slower: docs/kernels.md), it prefetches every k. */
    if (rows < ROWS)
        for (; kk + line_steps <= k; kk += line_steps) {
            __builtin_prefetch(ahead + kk * COLS * width, 0, 2);
            for (int64_t u = 0; u < line_steps; u++) STEP(kk + u)
        }
    for (; kk < k; kk++) {
        __builtin_prefetch(ahead + kk * COLS * width, 0, 2);
        STEP(kk)
    }
#undef STEP
#undef ZERO
#undef FMA
    const __m256 acc[ROWS][2] = {{a00, a01}, {a10, a11}, {a20, a21},
                                 {a30, a31}, {a40, a41}, {a50, a51}};
    for (int r = 0; r < rows; r++)
        finish(acc[r][0], acc[r][1], col0, n, bias,
               residual ? residual + r * residual_stride : 0, out + r * out_stride);
}

/* One row of x against blocks nb0 .. nb0 + blocks - 1 (blocks <= ONE_ROW_BLOCKS). With
 * one row, row_tile's work per k is one block's two FMAs, each waiting on the one
 * before: their latency, not the memory, set a decode step's pace. Four blocks side by
 * side give eight independent chains. They are four streams, so the tile prefetches
 * the next tile's weights into L2 in address order, as many lines per step as it
 * consumes (as narrow_linear_avx512.c's tiles). Each output's sum is row_tile's. */
enum { ONE_ROW_BLOCKS = 4 };

static inline __attribute__((always_inline)) void one_row_tile(
    const int blocks, const int format, const Problem *p, int64_t nb0, int64_t next_blocks) {
    const int64_t k = p->k;
    const float *x = p->x;
    const void *b0 = block_at(p, nb0), *b1 = 0, *b2 = 0, *b3 = 0;
    if (blocks > 1) b1 = block_at(p, nb0 + 1);
    if (blocks > 2) b2 = block_at(p, nb0 + 2);
    if (blocks > 3) b3 = block_at(p, nb0 + 3);
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
           a30 = a00, a31 = a00;
    const int64_t width = format_width(format);
    const int64_t line_steps = 64 / (COLS * width);
    const char *next = (const char *)block_at(p, nb0 + blocks);
    const int64_t next_bytes = next_blocks * k * COLS * width;
    for (int64_t kk = 0; kk < k; kk++) {
        if (kk % line_steps == 0) prefetch_next_tile(next, next_bytes, kk / line_steps, blocks);
        const __m256 xb = _mm256_broadcast_ss(x + kk);
        __m256 lo, hi;
        widen(format, b0, kk, &lo, &hi);
        a00 = _mm256_fmadd_ps(xb, lo, a00), a01 = _mm256_fmadd_ps(xb, hi, a01);
        if (blocks > 1) {
            widen(format, b1, kk, &lo, &hi);
            a10 = _mm256_fmadd_ps(xb, lo, a10), a11 = _mm256_fmadd_ps(xb, hi, a11);
        }
        if (blocks > 2) {
            widen(format, b2, kk, &lo, &hi);
            a20 = _mm256_fmadd_ps(xb, lo, a20), a21 = _mm256_fmadd_ps(xb, hi, a21);
        }
        if (blocks > 3) {
            widen(format, b3, kk, &lo, &hi);
            a30 = _mm256_fmadd_ps(xb, lo, a30), a31 = _mm256_fmadd_ps(xb, hi, a31);
        }
    }
    const __m256 acc[ONE_ROW_BLOCKS][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
    for (int b = 0; b < blocks; b++)
        finish(acc[b][0], acc[b][1], (nb0 + b) * COLS, p->n, p->bias, p->residual, p->out);
}

/* Blocks [first, last) of one row, ONE_ROW_BLOCKS at a time. */
static void one_row(const Problem *p, int64_t first, int64_t last) {
    for (int64_t nb = first; nb < last; nb += ONE_ROW_BLOCKS) {
        const int blocks = last - nb < ONE_ROW_BLOCKS ? (int)(last - nb) : ONE_ROW_BLOCKS;
        const int64_t after = last - nb - blocks;
        const int64_t next = after < ONE_ROW_BLOCKS ? after : ONE_ROW_BLOCKS;
#define ONE(B)                                                               \
    if (p->format == FORMAT_BF16) one_row_tile(B, FORMAT_BF16, p, nb, next); \
    else one_row_tile(B, FORMAT_F32, p, nb, next);
        switch (blocks) {
            case 4: ONE(4) break;
            case 3: ONE(3) break;
            case 2: ONE(2) break;
            default: ONE(1) break;
        }
#undef ONE
    }
}

/* Rows [row0, row0 + rows) against column block nb. */
static void rows_at(const Problem *p, int rows, int64_t row0, int64_t nb, int has_next) {
    const void *block = block_at(p, nb);
    const float *x = p->x + row0 * p->x_stride;
    const float *residual = p->residual ? p->residual + row0 * p->residual_stride : 0;
    float *out = p->out + row0 * p->out_stride;
#define ROW_TILE(R, F)                                                                     \
    row_tile(R, F, x, p->x_stride, block, p->k, nb * COLS, p->n, p->bias, residual, \
             p->residual_stride, out, p->out_stride, has_next)
#define FORMATS(R)                                       \
    if (p->format == FORMAT_BF16) ROW_TILE(R, FORMAT_BF16); \
    else ROW_TILE(R, FORMAT_F32);
    switch (rows) {
        case 1: FORMATS(1) break;
        case 2: FORMATS(2) break;
        case 3: FORMATS(3) break;
        case 4: FORMATS(4) break;
        case 5: FORMATS(5) break;
        default: FORMATS(6) break;
    }
#undef FORMATS
#undef ROW_TILE
}

/* Column blocks [first, last) of out, all m rows: a chunk of blocks at a time, every
 * row tile over the chunk, so the chunk's weights come from memory once and from L2
 * for the later row tiles (on AVX-512, where `wide`, its own tiles). */
static void linear_blocks(const Problem *p, int64_t first, int64_t last, int wide) {
#if defined(__AVX512F__)
    /* One row has its own tiles below, as fast as these (docs/kernels.md). */
    if (wide && p->m > 1) {
        narrow_blocks_avx512(p, first, last);
        return;
    }
#endif
    (void)wide;
    if (p->m == 1) {
        one_row(p, first, last);
        return;
    }
    const int64_t chunk = chunk_blocks(p, last - first);
    for (int64_t start = first; start < last; start += chunk) {
        const int64_t stop = start + chunk < last ? start + chunk : last;
        for (int64_t row0 = 0; row0 < p->m; row0 += ROWS) {
            const int rows = p->m - row0 < ROWS ? (int)(p->m - row0) : ROWS;
            for (int64_t nb = start; nb < stop; nb++)
                rows_at(p, rows, row0, nb, nb + 1 < last);
        }
    }
}

static int run(const Problem *p, int wide, int32_t num_threads) {
    if (p->format != FORMAT_BF16 && p->format != FORMAT_INT8 && p->format != FORMAT_F32)
        return -1;
    if (p->m <= 0 || p->n <= 0) return 0;
    if (p->format == FORMAT_INT8) return narrow_int8_run(p, wide, num_threads);
    const int64_t nbs = (p->n + COLS - 1) / COLS;
    /* A second thread pays for its wake-up only with enough columns to share (as the
     * tile linears: every matrix of the models served here has 36 or more blocks). */
    const int threads = nbs >= 8 ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        linear_blocks(p, nbs * t / team, nbs * (t + 1) / team, wide);
    }
    return 0;
}
#endif

/* out = x . W^T (+ bias) (+ residual): x, bias, residual and out fp32, W packed by
 * the format's `chatsvc_narrow_linear_pack_*`; `scale` [n] for int8 (ignored for
 * the others). bias and residual may be NULL. Returns 0, or -1 where this build has no
 * AVX2 + FMA, the format is unknown or scratch memory ran out (int8's quantized rows;
 * nothing is written then). `wide_tiles` 1: the AVX-512 tiles in a build for a CPU that
 * has them (int8: AVX-512 VNNI), else the AVX2 ones; 0: the AVX2 tiles whatever the
 * build (the tests hold both to the same bits). */
int chatsvc_narrow_linear(const float *x, int64_t x_stride, int64_t m, const void *packed,
                          int32_t format, const float *scale, int64_t n, int64_t k,
                          const float *bias, const float *residual, int64_t residual_stride,
                          float *out, int64_t out_stride, int32_t wide_tiles,
                          int32_t num_threads) {
#if defined(CHATSVC_NARROW_LINEAR)
    const Problem p = {x, x_stride, m, packed, format, n, k, scale, bias, residual,
                       residual_stride, out, out_stride};
    return run(&p, wide_tiles != 0, num_threads);
#else
    (void)x, (void)x_stride, (void)m, (void)packed, (void)format, (void)scale, (void)n, (void)k;
    (void)bias, (void)residual, (void)residual_stride, (void)out, (void)out_stride;
    (void)wide_tiles, (void)num_threads;
    return -1;
#endif
}

/* 1 where `chatsvc_narrow_linear` runs (a build for a CPU with AVX2 and FMA), else 0. */
int chatsvc_narrow_linear_available(void) {
#if defined(CHATSVC_NARROW_LINEAR)
    return 1;
#else
    return 0;
#endif
}
