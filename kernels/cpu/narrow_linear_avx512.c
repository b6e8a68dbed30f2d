/* The row tiles of narrow_linear.c on AVX-512: one zmm holds a block's 16 columns.
 *
 * A tile takes up to ROWS rows of x against up to BLOCKS column blocks at once; the
 * four blocks share each broadcast of x. 6 x 4 accumulators, 4 widened blocks
 * and a broadcast fill 29 of the 32 registers.
 *
 * Per k a tile reads 16 weights of each of its blocks: four interleaved streams, which
 * the hardware prefetchers serve worse than one. So while a tile runs, it prefetches the
 * next tile's weights into L2 in address order, as many lines per step as it consumes.
 *
 * The sums are narrow_linear.c's, lane for lane: per output one FMA per k in ascending
 * order from zero, then + bias, then + residual. bf16 widens exactly (zero extension and
 * a shift of 16). A bf16 block's lanes hold its columns in
 * BF16_COLUMN_OF order (the AVX2 layout), put back in order by one permute at the end.
 * The last block's missing columns are masked off.
 */

#include "narrow_linear.h"

#if defined(__AVX512F__)
#include <immintrin.h>

enum { ROWS = 6, BLOCKS = 4 };

/* The 16 weights of step kk of a block, widened to fp32 (bf16: in block-place order). */
static inline __attribute__((always_inline)) __m512 widen16(const int format, const void *block,
                                                            int64_t kk) {
    if (format == FORMAT_BF16) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)((const uint16_t *)block + kk * COLS));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
    }
    return _mm512_loadu_ps((const float *)block + kk * COLS);
}

/* One finished sum of 16 columns of one row: bias, residual, store. */
static inline __attribute__((always_inline)) void finish(
    const int format, __m512 v, int64_t col0, int64_t n, const float *bias,
    const float *residual, float *out) {
    if (format == FORMAT_BF16) {
        const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
        v = _mm512_permutexvar_ps(order, v);
    }
    const int64_t live = n - col0 < COLS ? n - col0 : COLS;
    const __mmask16 mask = (__mmask16)((1u << live) - 1u);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + col0));
    if (residual) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, residual + col0));
    _mm512_mask_storeu_ps(out + col0, mask, v);
}

/* Rows [0, rows) of x against blocks nb0 .. nb0 + blocks - 1. `rows`, `blocks` and
 * `format` are constants in each caller, so everything unrolls into registers. */
static inline __attribute__((always_inline)) void tile(
    const int rows, const int blocks, const int format, const Problem *p, const float *x,
    const float *residual, float *out, int64_t nb0, int64_t next_blocks) {
    const int64_t k = p->k, xs = p->x_stride;
    const void *b0 = block_at(p, nb0), *b1 = 0, *b2 = 0, *b3 = 0;
    if (blocks > 1) b1 = block_at(p, nb0 + 1);
    if (blocks > 2) b2 = block_at(p, nb0 + 2);
    if (blocks > 3) b3 = block_at(p, nb0 + 3);
    /* Named accumulators, not an array: gcc would keep an array on the stack. */
#define ZERO(r)                                                               \
    __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0, a##r##2 = a##r##0, \
           a##r##3 = a##r##0;
#define FMA(r)                                                        \
    if (rows > r) {                                                   \
        const __m512 xb = _mm512_set1_ps(x[r * xs + kk]);             \
        a##r##0 = _mm512_fmadd_ps(xb, w0, a##r##0);                   \
        if (blocks > 1) a##r##1 = _mm512_fmadd_ps(xb, w1, a##r##1);   \
        if (blocks > 2) a##r##2 = _mm512_fmadd_ps(xb, w2, a##r##2);   \
        if (blocks > 3) a##r##3 = _mm512_fmadd_ps(xb, w3, a##r##3);   \
    }
    ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5)
    const int64_t width = format == FORMAT_BF16 ? 2 : 4;
    const int64_t line_steps = 64 / (COLS * width);
    const char *next = (const char *)block_at(p, nb0 + blocks);
    const int64_t next_bytes = next_blocks * k * COLS * width;
    for (int64_t kk = 0; kk < k; kk++) {
        if (kk % line_steps == 0) prefetch_next_tile(next, next_bytes, kk / line_steps, blocks);
        const __m512 w0 = widen16(format, b0, kk);
        __m512 w1 = w0, w2 = w0, w3 = w0;
        if (blocks > 1) w1 = widen16(format, b1, kk);
        if (blocks > 2) w2 = widen16(format, b2, kk);
        if (blocks > 3) w3 = widen16(format, b3, kk);
        FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5)
    }
#undef ZERO
#undef FMA
    const __m512 acc[ROWS][BLOCKS] = {{a00, a01, a02, a03}, {a10, a11, a12, a13},
                                      {a20, a21, a22, a23}, {a30, a31, a32, a33},
                                      {a40, a41, a42, a43}, {a50, a51, a52, a53}};
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++)
            finish(format, acc[r][b], (nb0 + b) * COLS, p->n, p->bias,
                   residual ? residual + r * p->residual_stride : 0, out + r * p->out_stride);
}

/* Rows [row0, row0 + rows) against blocks [nb0, nb0 + blocks), 1 <= blocks <= BLOCKS. */
static void tile_at(const Problem *p, int rows, int64_t row0, int blocks, int64_t nb0,
                    int64_t next_blocks) {
    const float *x = p->x + row0 * p->x_stride;
    const float *residual = p->residual ? p->residual + row0 * p->residual_stride : 0;
    float *out = p->out + row0 * p->out_stride;
#define TILE(R, B, F) tile(R, B, F, p, x, residual, out, nb0, next_blocks)
#define FORMATS(R, B)                                       \
    if (p->format == FORMAT_BF16) TILE(R, B, FORMAT_BF16); \
    else TILE(R, B, FORMAT_F32);
#define BLOCK_COUNTS(R)                             \
    if (blocks == 4) {                              \
        FORMATS(R, 4)                               \
    } else if (blocks == 3) {                       \
        FORMATS(R, 3)                               \
    } else if (blocks == 2) {                       \
        FORMATS(R, 2)                               \
    } else {                                        \
        FORMATS(R, 1)                               \
    }
    switch (rows) {
        case 1: BLOCK_COUNTS(1) break;
        case 2: BLOCK_COUNTS(2) break;
        case 3: BLOCK_COUNTS(3) break;
        case 4: BLOCK_COUNTS(4) break;
        case 5: BLOCK_COUNTS(5) break;
        default: BLOCK_COUNTS(6) break;
    }
#undef BLOCK_COUNTS
#undef FORMATS
#undef TILE
}

void narrow_blocks_avx512(const Problem *p, int64_t first, int64_t last) {
    /* Whole tiles per chunk: a chunk's last tile of fewer blocks would wait on its chains. */
    const int64_t chunk = (chunk_blocks(p, last - first) + BLOCKS - 1) / BLOCKS * BLOCKS;
    for (int64_t start = first; start < last; start += chunk) {
        const int64_t stop = start + chunk < last ? start + chunk : last;
        for (int64_t row0 = 0; row0 < p->m; row0 += ROWS) {
            const int rows = p->m - row0 < ROWS ? (int)(p->m - row0) : ROWS;
            for (int64_t nb = start; nb < stop; nb += BLOCKS) {
                const int blocks = stop - nb < BLOCKS ? (int)(stop - nb) : BLOCKS;
                const int64_t after = last - nb - blocks; /* blocks of the range left after */
                tile_at(p, rows, row0, blocks, nb, after < BLOCKS ? after : BLOCKS);
            }
        }
    }
}
#endif
