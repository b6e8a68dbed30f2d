/* Linear layers of bf16 models on CPUs with AVX512-BF16 but no tile unit (AMD Zen 4,
 * Intel before Sapphire Rapids):
 *
 *   out[M, N] = x[M, K] . W[N, K]^T (+ bias[N]) (+ residual[M, N])     all bf16
 *
 * vdpbf16ps multiplies pairs of bf16 and adds both products to an fp32 lane, so the
 * weights are used as stored, two inputs per instruction. Packed layout: 16-column
 * blocks, K in pairs (a zero after an odd K's last value), the pair of each column side
 * by side, one 64-byte vector per pair step:
 *
 *   packed[((nb * KP + kp) * 16 + c) * 2 + j] = W[16 nb + c][2 kp + j]      KP = ceil(K / 2)
 *
 * A row tile of up to six rows takes two column blocks at a time (12 accumulators);
 * each row's pair of inputs is broadcast as one dword. Every output is one fp32 sum
 * over the pairs in ascending order, then + bias, + residual (fp32) and one rounding
 * to bf16, as the tile linears (tile_linear.c) finish theirs: nothing in that order
 * depends on M, on the row's place among the rows or on the thread count, so a row's
 * output is bit-identical whatever else the step holds (kernels/invariance.py).
 * Arguments are checked by the Python wrapper (kernels/cpu/pair_linear.py).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "exports.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#define CHATSVC_PAIR_LINEAR 1
#endif

enum { COLS = 16, ROWS = 6 };

/* Bytes of weights a thread keeps in its L2 while every row tile passes over them. */
enum { CHUNK_BYTES = 256 * 1024 };

/* bf16 elements of W [n, k] once packed. */
int64_t chatsvc_pair_linear_packed_elements(int64_t n, int64_t k) {
    return (n + COLS - 1) / COLS * COLS * ((k + 1) / 2) * 2;
}

/* Pack W [n, k] (bf16, rows `w_stride` elements apart) into `packed`. */
void chatsvc_pair_linear_pack(const uint16_t *w, int64_t w_stride, int64_t n, int64_t k,
                              uint16_t *packed) {
    const int64_t nbs = (n + COLS - 1) / COLS, kps = (k + 1) / 2;
    for (int64_t nb = 0; nb < nbs; nb++)
        for (int64_t kp = 0; kp < kps; kp++)
            for (int c = 0; c < COLS; c++)
                for (int j = 0; j < 2; j++) {
                    const int64_t row = nb * COLS + c, col = 2 * kp + j;
                    packed[((nb * kps + kp) * COLS + c) * 2 + j] =
                        row < n && col < k ? w[row * w_stride + col] : 0;
                }
}

#if defined(CHATSVC_PAIR_LINEAR)
typedef struct {
    const uint16_t *x;
    int64_t x_stride, m;
    const uint16_t *packed;
    int64_t n, k;
    const uint16_t *bias, *residual;
    int64_t residual_stride;
    uint16_t *out;
    int64_t out_stride;
} Problem;

static inline __m512 widen16(const uint16_t *src, __mmask16 live) {
    const __m256i h = _mm256_maskz_loadu_epi16(live, src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Row r's sums of one column block (col0..col0 + 16) + bias + residual, rounded once. */
static inline void finish(const Problem *p, int64_t row, int64_t col0, __m512 sums) {
    const int64_t live_cols = p->n - col0 < COLS ? p->n - col0 : COLS;
    const __mmask16 live = (__mmask16)((1u << live_cols) - 1u);
    __m512 v = sums;
    if (p->bias) v = _mm512_add_ps(v, widen16(p->bias + col0, live));
    if (p->residual) v = _mm512_add_ps(v, widen16(p->residual + row * p->residual_stride + col0, live));
    _mm256_mask_storeu_epi16(p->out + row * p->out_stride + col0, live,
                             (__m256i)_mm512_cvtneps_pbh(v));
}

/* The input pair kp of a row as one dword: (x[2kp], x[2kp + 1]); `last` alone for the
 * last pair of an odd K (its second input is zero, as the packed weight's). */
static inline __m512bh pair_of(const uint16_t *row, int64_t kp, int lone) {
    uint32_t dword;
    if (lone)
        dword = row[2 * kp];
    else
        memcpy(&dword, row + 2 * kp, sizeof dword);
    return (__m512bh)_mm512_set1_epi32((int)dword);
}

/* Rows [row0, row0 + rows) (rows <= ROWS, a constant in each caller) against column
 * blocks nb and, where `two`, nb + 1. Named accumulators: an array would be spilled. */
static inline __attribute__((always_inline)) void row_tile(const Problem *p, const int rows,
                                                           int64_t row0, int64_t nb, int two) {
    const int64_t kps = (p->k + 1) / 2;
    const uint16_t *w0 = p->packed + nb * kps * COLS * 2;
    const uint16_t *w1 = two ? w0 + kps * COLS * 2 : w0;
    const uint16_t *x = p->x + row0 * p->x_stride;
#define ZERO(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = _mm512_setzero_ps();
#define DOT(r)                                                                   \
    if (rows > r) {                                                              \
        const __m512bh xr = pair_of(x + r * p->x_stride, kp, lone);              \
        a##r##0 = _mm512_dpbf16_ps(a##r##0, xr, b0);                             \
        if (two) a##r##1 = _mm512_dpbf16_ps(a##r##1, xr, b1);                    \
    }
#define STEP                                                                     \
    {                                                                            \
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + kp * COLS * 2);   \
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w1 + kp * COLS * 2);   \
        DOT(0) DOT(1) DOT(2) DOT(3) DOT(4) DOT(5)                                \
    }
    ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5)
    int64_t kp = 0;
    for (const int lone = 0; kp < p->k / 2; kp++) STEP
    if (p->k % 2) {
        const int lone = 1;
        STEP
    }
#undef STEP
#undef ZERO
#undef DOT
    const __m512 acc[ROWS][2] = {{a00, a01}, {a10, a11}, {a20, a21},
                                 {a30, a31}, {a40, a41}, {a50, a51}};
    for (int r = 0; r < rows; r++) {
        finish(p, row0 + r, nb * COLS, acc[r][0]);
        if (two) finish(p, row0 + r, (nb + 1) * COLS, acc[r][1]);
    }
}

static void rows_at(const Problem *p, int rows, int64_t row0, int64_t nb, int two) {
    switch (rows) {
        case 1: row_tile(p, 1, row0, nb, two); break;
        case 2: row_tile(p, 2, row0, nb, two); break;
        case 3: row_tile(p, 3, row0, nb, two); break;
        case 4: row_tile(p, 4, row0, nb, two); break;
        case 5: row_tile(p, 5, row0, nb, two); break;
        default: row_tile(p, 6, row0, nb, two); break;
    }
}

/* Column blocks [first, last) of out, all m rows: a chunk of blocks at a time, every
 * row tile over the chunk, so its weights come from memory once and from L2 after. */
static void linear_blocks(const Problem *p, int64_t first, int64_t last) {
    const int64_t block_bytes = (p->k + 1) / 2 * COLS * 4;
    int64_t chunk = block_bytes > 0 ? CHUNK_BYTES / block_bytes : last - first;
    chunk = chunk < 2 ? 2 : chunk & ~(int64_t)1;
    for (int64_t start = first; start < last; start += chunk) {
        const int64_t stop = start + chunk < last ? start + chunk : last;
        for (int64_t row0 = 0; row0 < p->m; row0 += ROWS) {
            const int rows = p->m - row0 < ROWS ? (int)(p->m - row0) : ROWS;
            for (int64_t nb = start; nb < stop; nb += 2) rows_at(p, rows, row0, nb, nb + 1 < stop);
        }
    }
}
#endif

/* out = x . W^T (+ bias) (+ residual), all bf16; W packed by `chatsvc_pair_linear_pack`.
 * bias and residual may be NULL. Returns 0, or -1 where this build has no AVX512-BF16
 * (nothing is written then). */
int chatsvc_pair_linear(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                        int64_t n, int64_t k, const uint16_t *bias, const uint16_t *residual,
                        int64_t residual_stride, uint16_t *out, int64_t out_stride,
                        int32_t num_threads) {
#if defined(CHATSVC_PAIR_LINEAR)
    if (m <= 0 || n <= 0) return 0;
    const Problem p = {x, x_stride, m, packed, n, k, bias, residual, residual_stride,
                       out, out_stride};
    const int64_t nbs = (n + COLS - 1) / COLS;
    /* A second thread pays for its wake-up only with enough columns to share; threads
     * take even runs of blocks, so every block pairs with its neighbour the same way. */
    const int threads = nbs >= 8 ? num_threads : 1;
    const int64_t pairs = (nbs + 1) / 2;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        const int64_t first = 2 * (pairs * t / team), last = 2 * (pairs * (t + 1) / team);
        linear_blocks(&p, first, last < nbs ? last : nbs);
    }
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)packed, (void)n, (void)k, (void)bias;
    (void)residual, (void)residual_stride, (void)out, (void)out_stride, (void)num_threads;
    return -1;
#endif
}

/* 1 where `chatsvc_pair_linear` runs (a build for a CPU with AVX512-BF16), else 0. */
int chatsvc_pair_linear_available(void) {
#if defined(CHATSVC_PAIR_LINEAR)
    return 1;
#else
    return 0;
#endif
}
