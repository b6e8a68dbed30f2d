/* Linear layers of bf16 models on CPUs with a tile unit (AMX):
 *
 *   out[M, N] = x[M, K] . W[N, K]^T (+ bias[N]) (+ residual[M, N])
 *
 * A decode step reads every weight once for a few dozen rows of x, so its linears
 * are bound by streaming the weights. torch's oneDNN linears (prepacked) read them
 * more slowly and spend a fixed cost per call besides; this loop streams a layout
 * made for the tile unit, one sequential run per thread (the rates: docs/kernels.md,
 * "Tile linears", python -m bench.linear).
 *
 * Packed layout of W, the tile unit's B operand as it loads (pairs of K for each of
 * 16 columns), zero-padded to whole 16-column blocks and 32-deep K steps:
 *
 *   packed[((nb * KB + kb) * 16 + kp) * 32 + 2 * c + j] = W[16 nb + c][32 kb + 2 kp + j]
 *
 * Each thread takes a contiguous run of column blocks. Per two column blocks and two
 * 16-row tiles of x it keeps four accumulator tiles: C[m][n] += A[m] . B[n] over K,
 * so every tile loaded feeds two multiplies. Sums are fp32; bias and residual are
 * added in fp32 and the result rounded to bf16 once, as oneDNN's fused add does.
 * Arguments are checked by the Python wrapper (kernels/cpu/tile_linear.py).
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "common.h"
#include "exports.h"

#if defined(CHATSVC_AMX)
#include <omp.h>
#endif

enum { COLS = 16, DEPTH = 32, TILE_ELEMS = COLS * DEPTH };

/* bf16 elements of W [n, k] once packed. */
int64_t chatsvc_linear_packed_elements(int64_t n, int64_t k) {
    return (n + COLS - 1) / COLS * ((k + DEPTH - 1) / DEPTH) * TILE_ELEMS;
}

/* Pack W [n, k] (rows `w_stride` elements apart, bf16) into `packed`. */
void chatsvc_linear_pack(const uint16_t *w, int64_t w_stride, int64_t n, int64_t k,
                         uint16_t *packed) {
    const int64_t nbs = (n + COLS - 1) / COLS, kbs = (k + DEPTH - 1) / DEPTH;
    for (int64_t nb = 0; nb < nbs; nb++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            uint16_t *tile = packed + (nb * kbs + kb) * TILE_ELEMS;
            for (int kp = 0; kp < DEPTH / 2; kp++)
                for (int c = 0; c < COLS; c++)
                    for (int j = 0; j < 2; j++) {
                        const int64_t row = nb * COLS + c, col = kb * DEPTH + 2 * kp + j;
                        tile[kp * 2 * COLS + 2 * c + j] = row < n && col < k ? w[row * w_stride + col] : 0;
                    }
        }
}

#if defined(CHATSVC_AMX)
/* Rows of accumulator tile `c` (16 x 16 fp32, already stored to `acc`) plus bias and
 * residual, rounded into out: rows [row0, row0 + rows), columns [col0, col0 + 16). */
static void finish_tile(const float *acc, int64_t row0, int rows, int64_t col0, int64_t n,
                        const uint16_t *bias, const uint16_t *residual, int64_t residual_stride,
                        uint16_t *out, int64_t out_stride) {
    const __mmask16 live = n - col0 >= COLS ? 0xffff : (__mmask16)((1u << (n - col0)) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias)
        b = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, bias + col0)), 16));
    for (int r = 0; r < rows; r++) {
        __m512 v = _mm512_add_ps(_mm512_load_ps(acc + r * COLS), b);
        if (residual) {
            const __m256i h =
                _mm256_maskz_loadu_epi16(live, residual + (row0 + r) * residual_stride + col0);
            v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
        _mm256_mask_storeu_epi16(out + (row0 + r) * out_stride + col0, live,
                                 (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* Accumulator tile q (0..3) to memory: tile numbers must be literals. */
static inline void store_acc(int q, float *acc) {
    switch (q) {
        case 0: _tile_stored(0, acc, COLS * 4); break;
        case 1: _tile_stored(1, acc, COLS * 4); break;
        case 2: _tile_stored(2, acc, COLS * 4); break;
        default: _tile_stored(3, acc, COLS * 4); break;
    }
}

/* Column blocks [first, last) of out, all rows. xp: x packed as [row tiles * 16][kp]. */
static void linear_blocks(const uint16_t *xp, int64_t kp_len, int64_t m, const uint16_t *packed,
                          int64_t n, int64_t kbs, int64_t first, int64_t last,
                          const uint16_t *bias, const uint16_t *residual,
                          int64_t residual_stride, uint16_t *out, int64_t out_stride) {
    const int64_t row_tiles = (m + 15) / 16;
    float acc[16 * COLS] __attribute__((aligned(64)));
    for (int64_t nb = first; nb < last; nb += 2) {
        const int two_n = nb + 1 < last;
        const uint16_t *w0 = packed + nb * kbs * TILE_ELEMS, *w1 = w0 + kbs * TILE_ELEMS;
        for (int64_t mt = 0; mt < row_tiles; mt += 2) {
            const int two_m = mt + 1 < row_tiles;
            const uint16_t *x0 = xp + mt * 16 * kp_len, *x1 = x0 + 16 * kp_len;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < kbs; kb++) {
                if (mt == 0) { /* the weights' first pass: fetch 8 steps ahead */
                    const char *ahead0 = (const char *)(w0 + (kb + 8) * TILE_ELEMS);
                    const char *ahead1 = (const char *)(w1 + (kb + 8) * TILE_ELEMS);
                    for (int line = 0; line < 16; line += 4) {
                        _mm_prefetch(ahead0 + 64 * line, _MM_HINT_T0);
                        if (two_n) _mm_prefetch(ahead1 + 64 * line, _MM_HINT_T0);
                    }
                }
                _tile_loadd(4, x0 + kb * DEPTH, kp_len * 2);
                _tile_loadd(6, w0 + kb * TILE_ELEMS, COLS * 4);
                _tile_dpbf16ps(0, 4, 6);
                if (two_n) {
                    _tile_loadd(7, w1 + kb * TILE_ELEMS, COLS * 4);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two_m) {
                    _tile_loadd(5, x1 + kb * DEPTH, kp_len * 2);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two_n) _tile_dpbf16ps(3, 5, 7);
                }
            }
            for (int q = 0; q < 4; q++) {
                const int64_t tile_row = mt + q / 2, block = nb + q % 2;
                if ((q / 2 && !two_m) || (q % 2 && !two_n)) continue;
                store_acc(q, acc);
                const int64_t row0 = tile_row * 16;
                const int rows = m - row0 < 16 ? (int)(m - row0) : 16;
                finish_tile(acc, row0, rows, block * COLS, n, bias, residual, residual_stride,
                            out, out_stride);
            }
        }
    }
}
#endif

/* out = x . W^T (+ bias) (+ residual), all bf16; W packed by `chatsvc_linear_pack`.
 * bias and residual may be NULL. Returns 0, or -1 where there is no tile unit (or
 * scratch memory runs out); nothing is written then. */
int chatsvc_linear(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                   int64_t n, int64_t k, const uint16_t *bias, const uint16_t *residual,
                   int64_t residual_stride, uint16_t *out, int64_t out_stride,
                   int32_t num_threads) {
#if defined(CHATSVC_AMX)
    if (!amx_usable()) return -1;
    if (m <= 0 || n <= 0) return 0;
    const int64_t kbs = (k + DEPTH - 1) / DEPTH, kp_len = kbs * DEPTH;
    const int64_t row_tiles = (m + 15) / 16, nbs = (n + COLS - 1) / COLS;
    /* x as whole 16-row tiles and 32-deep steps, zeros past its edges. */
    uint16_t *xp = aligned_alloc(64, (size_t)(row_tiles * 16 * kp_len * 2));
    if (!xp) return -1;
    for (int64_t r = 0; r < row_tiles * 16; r++) {
        uint16_t *dst = xp + r * kp_len;
        if (r < m) {
            memcpy(dst, x + r * x_stride, (size_t)k * 2);
            memset(dst + k, 0, (size_t)(kp_len - k) * 2);
        } else {
            memset(dst, 0, (size_t)kp_len * 2);
        }
    }
    /* A second thread pays for its wake-up only with enough columns to share (8 blocks:
     * a guess, not measured; every matrix of the models served here has 36 or more). */
    const int threads = nbs >= 8 ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        amx_configure();
        linear_blocks(xp, kp_len, m, packed, n, kbs, nbs * t / team, nbs * (t + 1) / team, bias,
                      residual, residual_stride, out, out_stride);
        _tile_release();
    }
    free(xp);
    return 0;
#else
    (void)x, (void)x_stride, (void)m, (void)packed, (void)n, (void)k, (void)bias;
    (void)residual, (void)residual_stride, (void)out, (void)out_stride, (void)num_threads;
    return -1;
#endif
}

/* 1 where `chatsvc_linear` runs (a build for a CPU with AMX, and the kernel grants
 * the tile state), else 0. */
int chatsvc_linear_uses_tiles(void) { return amx_usable(); }
