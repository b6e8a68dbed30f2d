/* The int8 format of narrow_linear.c: int8 weights against rows of x quantized to int8
 * per group of GROUP values, summed by integer dot products (AVX-512 VNNI's dpbusd, or
 * AVX2's maddubs where the CPU has no VNNI). Widening every weight to fp32 for an FMA
 * took three instructions per 16 weights and kept one row of a decode step below the
 * memory's speed; one dpbusd multiplies and sums 64 weight bytes.
 *
 *   x[r][k]  ~ xs[r][g] * xq[r][k]     g = k / GROUP: symmetric, xs = group peak / 127,
 *                                      xq = x / xs rounded to nearest even (quantize_rows)
 *   W[n][k]  ~ ws[n] * q[n][k]         kernels/cpu/narrow_linear.py: quantize_int8
 *   out[r][n] = ws[n] * sum_g xs[r][g] * (sum_{k in g} xq[r][k] q[n][k])  (+ bias) (+ residual)
 *
 * A group's integer sum is exact however it was added up (|sum| <= 32 * 127 * 127 < 2^24,
 * so exact in fp32 too). The groups are then summed in fp32 in ascending order, one FMA
 * each from zero, then one fused x ws[n] + bias, then + residual: every lane the same
 * operations on the VNNI and the AVX2 tiles, at any row count and on any thread, so a
 * row's output does not depend on the step it is in nor on the CPU's vector width. Why
 * groups of 32 and not one scale per row: docs/benchmarks.md (a row's outlier channels
 * cost 3.8 % perplexity at one scale per row, 0.5 % at 32).
 *
 * Packed layout (narrow_pack.c), K padded with zeros to KP, a multiple of GROUP; 16-column
 * blocks, four consecutive k of one column adjacent (the four bytes dpbusd sums per lane):
 *
 *   packed[((nb * KP / 4 + kq) * 16 + c) * 4 + j] = q[16 nb + c][4 kq + j] + 128
 *
 * stored unsigned (128 past row N or column K) because dpbusd multiplies unsigned bytes
 * by signed ones: sum (q + 128) xq = sum q xq + 128 sum xq, the second term one number per
 * row and group, taken off once per group. AVX2's maddubs would saturate its 16-bit pair
 * sums with unsigned bytes up to 255, so there the offset is flipped off (xor 0x80) and
 * x's signs move onto the weights: |xq| * sign(q, xq), pairs at most 2 * 127 * 127.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "narrow_linear.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define CHATSVC_INT8_VNNI 1 /* the dpbusd tiles, where `wide` asks for them */
#endif

/* x's rows quantized per group (one scratch area, quantize_row fills it). */
typedef struct {
    int64_t kp, groups;
    int8_t *q;     /* [m][kp] */
    float *scale;  /* [m][groups] */
    int32_t *sum;  /* [m][groups]: sum of the group's q (dpbusd's offset) */
} Rows;

static inline int32_t quad_at(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return v;
}

/* 8 int32 in [-127, 127] as 8 bytes. */
static inline void store_bytes(__m256i v, int8_t *out) {
    const __m256i words = _mm256_packs_epi32(v, v);      /* per lane: v0-3 v0-3 | v4-7 v4-7 */
    const __m256i bytes = _mm256_packs_epi16(words, words);
    const int32_t lo = _mm256_cvtsi256_si32(bytes);
    const int32_t hi = _mm_cvtsi128_si32(_mm256_extracti128_si256(bytes, 1));
    memcpy(out, &lo, 4);
    memcpy(out + 4, &hi, 4);
}

/* Row r of x into rows->q/scale/sum, group by group (the last one zero-padded). */
static void quantize_row(const Problem *p, int64_t r, const Rows *rows) {
    const float *x = p->x + r * p->x_stride;
    int8_t *q = rows->q + r * rows->kp;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    for (int64_t g = 0; g < rows->groups; g++) {
        float group[GROUP] __attribute__((aligned(32)));
        const int64_t k0 = g * GROUP, live = p->k - k0 < GROUP ? p->k - k0 : GROUP;
        memcpy(group, x + k0, (size_t)live * sizeof(float));
        memset(group + live, 0, (size_t)(GROUP - live) * sizeof(float));
        __m256 peak = _mm256_setzero_ps();
        for (int i = 0; i < GROUP; i += 8)
            peak = _mm256_max_ps(peak, _mm256_and_ps(_mm256_load_ps(group + i), magnitude));
        float lanes[8] __attribute__((aligned(32)));
        _mm256_store_ps(lanes, peak);
        float top_value = 0.0f;
        for (int i = 0; i < 8; i++) top_value = lanes[i] > top_value ? lanes[i] : top_value;
        const float step = top_value / 127.0f;
        rows->scale[r * rows->groups + g] = step;
        if (step == 0.0f) { /* an all-zero group (or one of subnormals): sums of zero */
            memset(q + k0, 0, GROUP);
            rows->sum[r * rows->groups + g] = 0;
            continue;
        }
        const __m256 divisor = _mm256_set1_ps(step);
        __m256i total = _mm256_setzero_si256();
        for (int i = 0; i < GROUP; i += 8) {
            /* Division, not a multiply by 127 / peak: the torch twin's exact rounding. */
            __m256i v = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_load_ps(group + i), divisor));
            v = _mm256_max_epi32(_mm256_min_epi32(v, top), bottom);
            total = _mm256_add_epi32(total, v);
            store_bytes(v, q + k0 + i);
        }
        int32_t parts[8];
        _mm256_storeu_si256((__m256i *)parts, total);
        int32_t sum = 0;
        for (int i = 0; i < 8; i++) sum += parts[i];
        rows->sum[r * rows->groups + g] = sum;
    }
}

static inline const uint8_t *int8_block(const Problem *p, int64_t kp, int64_t nb) {
    return (const uint8_t *)p->packed + nb * kp * COLS;
}

/* out's 16 columns from col0 of one row: acc * ws + bias, + residual; the last block's
 * missing columns are not written. */
static inline void finish_avx2(const float *acc, int64_t col0, int64_t n, const Problem *p,
                               const float *residual, float *out) {
    const int64_t live = n - col0 < COLS ? n - col0 : COLS;
    if (live == COLS) {
        for (int h = 0; h < 2; h++) {
            const int64_t c = col0 + 8 * h;
            const __m256 b = p->bias ? _mm256_loadu_ps(p->bias + c) : _mm256_setzero_ps();
            __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(acc + 8 * h), _mm256_loadu_ps(p->scale + c), b);
            if (residual) v = _mm256_add_ps(v, _mm256_loadu_ps(residual + c));
            _mm256_storeu_ps(out + c, v);
        }
        return;
    }
    for (int64_t c = 0; c < live; c++) {
        float v = __builtin_fmaf(acc[c], p->scale[col0 + c], p->bias ? p->bias[col0 + c] : 0.0f);
        if (residual) v += residual[col0 + c];
        out[col0 + c] = v;
    }
}

enum { AVX2_ROWS = 2, AVX2_BLOCKS = 2 };

/* Quantized rows up to this size live on the caller's stack (8 rows of K = 1536). */
enum { SMALL_SCRATCH_BYTES = 16 * 1024 };

/* Rows [row0, row0 + rows) against blocks [nb0, nb0 + blocks) with AVX2's maddubs.
 * `rows` and `blocks` are constants in each caller, so the accumulators (two per row and
 * block: columns 0-7 and 8-15) stay in registers; the fp32 sums live in `acc`. As
 * tile_vnni, it prefetches the next tile's bytes (`next_blocks` blocks) into L2 as fast
 * as it consumes its own: left to the hardware prefetchers, even one row's single
 * stream waited on memory (docs/kernels.md). */
static inline __attribute__((always_inline)) void tile_avx2(
    const int rows, const int blocks, const Problem *p, const Rows *x, int64_t row0,
    int64_t nb0, int64_t next_blocks) {
    const int64_t kp = x->kp;
    const uint8_t *w0 = int8_block(p, kp, nb0), *w1 = blocks > 1 ? int8_block(p, kp, nb0 + 1) : w0;
    const char *next = (const char *)int8_block(p, kp, nb0 + blocks);
    const int64_t next_bytes = next_blocks * kp * COLS;
    float acc[AVX2_ROWS][AVX2_BLOCKS][COLS] __attribute__((aligned(32))) = {{{0}}};
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
#define ZERO(r, b) __m256i i##r##b##0 = _mm256_setzero_si256(), i##r##b##1 = i##r##b##0;
#define DOT(r, b)                                                                           \
    if (rows > r && blocks > b) {                                                           \
        const __m256i s0 = _mm256_sign_epi8(w##b##0, xb##r), s1 = _mm256_sign_epi8(w##b##1, xb##r); \
        i##r##b##0 = _mm256_add_epi32(i##r##b##0,                                          \
                                      _mm256_madd_epi16(_mm256_maddubs_epi16(ax##r, s0), ones)); \
        i##r##b##1 = _mm256_add_epi32(i##r##b##1,                                          \
                                      _mm256_madd_epi16(_mm256_maddubs_epi16(ax##r, s1), ones)); \
    }
#define FLUSH(r, b)                                                                         \
    if (rows > r && blocks > b) {                                                           \
        const __m256 step = _mm256_set1_ps(x->scale[(row0 + r) * x->groups + g]);           \
        float *a = acc[r][b];                                                               \
        _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i##r##b##0), step, _mm256_load_ps(a))); \
        _mm256_store_ps(a + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i##r##b##1), step,       \
                                               _mm256_load_ps(a + 8)));                    \
    }
    for (int64_t g = 0; g < x->groups; g++) {
        ZERO(0, 0) ZERO(0, 1) ZERO(1, 0) ZERO(1, 1)
        for (int64_t kq = g * (GROUP / 4); kq < (g + 1) * (GROUP / 4); kq++) {
            prefetch_next_tile(next, next_bytes, kq, blocks);
            const __m256i w00 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w0 + kq * 64)), flip);
            const __m256i w01 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w0 + kq * 64 + 32)), flip);
            __m256i w10 = w00, w11 = w01;
            if (blocks > 1) {
                w10 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w1 + kq * 64)), flip);
                w11 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w1 + kq * 64 + 32)), flip);
            }
            const __m256i xb0 = _mm256_set1_epi32(quad_at(x->q + row0 * kp + kq * 4));
            const __m256i ax0 = _mm256_abs_epi8(xb0);
            __m256i xb1 = xb0, ax1 = ax0;
            if (rows > 1) {
                xb1 = _mm256_set1_epi32(quad_at(x->q + (row0 + 1) * kp + kq * 4));
                ax1 = _mm256_abs_epi8(xb1);
            }
            DOT(0, 0) DOT(0, 1) DOT(1, 0) DOT(1, 1)
        }
        FLUSH(0, 0) FLUSH(0, 1) FLUSH(1, 0) FLUSH(1, 1)
    }
#undef ZERO
#undef DOT
#undef FLUSH
    for (int r = 0; r < rows; r++) {
        const int64_t row = row0 + r;
        const float *residual = p->residual ? p->residual + row * p->residual_stride : 0;
        for (int b = 0; b < blocks; b++)
            finish_avx2(acc[r][b], (nb0 + b) * COLS, p->n, p, residual, p->out + row * p->out_stride);
    }
}

#if defined(CHATSVC_INT8_VNNI)
enum { VNNI_ROWS = 4, VNNI_BLOCKS = 4 };

/* finish_avx2's operations, lane for lane, on one zmm: out's 16 columns from col0 of
 * `row`, the last block's missing columns masked off. */
static inline void finish_avx512(__m512 acc, int64_t col0, const Problem *p, int64_t row) {
    const int64_t live = p->n - col0 < COLS ? p->n - col0 : COLS;
    const __mmask16 mask = (__mmask16)((1u << live) - 1u);
    const __m512 bias = p->bias ? _mm512_maskz_loadu_ps(mask, p->bias + col0) : _mm512_setzero_ps();
    __m512 v = _mm512_fmadd_ps(acc, _mm512_maskz_loadu_ps(mask, p->scale + col0), bias);
    if (p->residual)
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, p->residual + row * p->residual_stride + col0));
    _mm512_mask_storeu_ps(p->out + row * p->out_stride + col0, mask, v);
}

/* Rows [row0, row0 + rows) against blocks [nb0, nb0 + blocks) with dpbusd: one zmm is a
 * block's 16 columns x 4 k. Per k-quad a tile reads 64 bytes of each of its blocks, four
 * streams the hardware prefetchers serve worse than one, so it prefetches the next tile's
 * bytes (`next_blocks` of them) into L2 as fast as it consumes its own. */
static inline __attribute__((always_inline)) void tile_vnni(
    const int rows, const int blocks, const Problem *p, const Rows *x, int64_t row0,
    int64_t nb0, int64_t next_blocks) {
    const int64_t kp = x->kp;
    const uint8_t *w0 = int8_block(p, kp, nb0);
    const uint8_t *w1 = blocks > 1 ? int8_block(p, kp, nb0 + 1) : w0;
    const uint8_t *w2 = blocks > 2 ? int8_block(p, kp, nb0 + 2) : w0;
    const uint8_t *w3 = blocks > 3 ? int8_block(p, kp, nb0 + 3) : w0;
    const char *next = (const char *)int8_block(p, kp, nb0 + blocks);
    const int64_t next_bytes = next_blocks * kp * COLS;
    float acc[VNNI_ROWS][VNNI_BLOCKS][COLS] __attribute__((aligned(64))) = {{{0}}};
#define ZERO(r) __m512i i##r##0 = _mm512_setzero_si512(), i##r##1 = i##r##0, i##r##2 = i##r##0, i##r##3 = i##r##0;
#define DOT(r)                                                                       \
    if (rows > r) {                                                                  \
        const __m512i xb = _mm512_set1_epi32(quad_at(x->q + (row0 + r) * kp + kq * 4)); \
        i##r##0 = _mm512_dpbusd_epi32(i##r##0, v0, xb);                              \
        if (blocks > 1) i##r##1 = _mm512_dpbusd_epi32(i##r##1, v1, xb);              \
        if (blocks > 2) i##r##2 = _mm512_dpbusd_epi32(i##r##2, v2, xb);              \
        if (blocks > 3) i##r##3 = _mm512_dpbusd_epi32(i##r##3, v3, xb);              \
    }
#define FLUSH_ONE(r, b)                                                                        \
    acc_row[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i##r##b, offset)), step, \
                                 acc_row[b]);
#define FLUSH(r)                                                                    \
    if (rows > r) {                                                                 \
        const int64_t at = (row0 + r) * x->groups + g;                              \
        const __m512i offset = _mm512_set1_epi32(128 * x->sum[at]);                 \
        const __m512 step = _mm512_set1_ps(x->scale[at]);                           \
        __m512 acc_row[VNNI_BLOCKS];                                                \
        for (int b = 0; b < blocks; b++) acc_row[b] = _mm512_load_ps(acc[r][b]);    \
        FLUSH_ONE(r, 0)                                                             \
        if (blocks > 1) FLUSH_ONE(r, 1)                                             \
        if (blocks > 2) FLUSH_ONE(r, 2)                                             \
        if (blocks > 3) FLUSH_ONE(r, 3)                                             \
        for (int b = 0; b < blocks; b++) _mm512_store_ps(acc[r][b], acc_row[b]);    \
    }
    for (int64_t g = 0; g < x->groups; g++) {
        ZERO(0) ZERO(1) ZERO(2) ZERO(3)
        for (int64_t kq = g * (GROUP / 4); kq < (g + 1) * (GROUP / 4); kq++) {
            prefetch_next_tile(next, next_bytes, kq, blocks);
            const __m512i v0 = _mm512_loadu_si512(w0 + kq * 64);
            __m512i v1 = v0, v2 = v0, v3 = v0;
            if (blocks > 1) v1 = _mm512_loadu_si512(w1 + kq * 64);
            if (blocks > 2) v2 = _mm512_loadu_si512(w2 + kq * 64);
            if (blocks > 3) v3 = _mm512_loadu_si512(w3 + kq * 64);
            DOT(0) DOT(1) DOT(2) DOT(3)
        }
        FLUSH(0) FLUSH(1) FLUSH(2) FLUSH(3)
    }
#undef ZERO
#undef DOT
#undef FLUSH_ONE
#undef FLUSH
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++)
            finish_avx512(_mm512_load_ps(acc[r][b]), (nb0 + b) * COLS, p, row0 + r);
}

/* One row (a decode step) against one block, with dpbusd: a thread's blocks lie one after
 * another, so one row reads them as one sequential stream, which the hardware prefetchers
 * serve best. A group's integer sum is split over four accumulators (k-quads mod 4) so
 * the chain of dpbusd does not wait on its own latency: integers add up to the same sum
 * in any order. */
static void row_vnni(const Problem *p, const Rows *x, int64_t row, int64_t nb) {
    const int64_t kp = x->kp;
    const uint8_t *w = int8_block(p, kp, nb);
    const int8_t *q = x->q + row * kp;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < x->groups; g++) {
        __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t kq = g * (GROUP / 4); kq < (g + 1) * (GROUP / 4); kq += 4) {
            const uint8_t *v = w + kq * 64;
            const int8_t *xq = q + kq * 4;
            s0 = _mm512_dpbusd_epi32(s0, _mm512_loadu_si512(v), _mm512_set1_epi32(quad_at(xq)));
            s1 = _mm512_dpbusd_epi32(s1, _mm512_loadu_si512(v + 64), _mm512_set1_epi32(quad_at(xq + 4)));
            s2 = _mm512_dpbusd_epi32(s2, _mm512_loadu_si512(v + 128), _mm512_set1_epi32(quad_at(xq + 8)));
            s3 = _mm512_dpbusd_epi32(s3, _mm512_loadu_si512(v + 192), _mm512_set1_epi32(quad_at(xq + 12)));
        }
        const int64_t at = row * x->groups + g;
        const __m512i sum = _mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3));
        const __m512i offset = _mm512_set1_epi32(128 * x->sum[at]);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, offset)),
                              _mm512_set1_ps(x->scale[at]), acc);
    }
    finish_avx512(acc, nb * COLS, p, row);
}
#endif

/* Rows [row0, row0 + rows) against blocks [nb0, nb0 + blocks), the tile's constants
 * spelled out so each copy unrolls. */
static void tile_at(const Problem *p, const Rows *x, int wide, int rows, int64_t row0,
                    int blocks, int64_t nb0, int64_t next_blocks) {
#if defined(CHATSVC_INT8_VNNI)
    if (wide) {
#define T(R, B) tile_vnni(R, B, p, x, row0, nb0, next_blocks)
#define BLOCK_COUNTS(R)                                           \
    if (blocks == 4) T(R, 4);                                     \
    else if (blocks == 3) T(R, 3);                                \
    else if (blocks == 2) T(R, 2);                                \
    else T(R, 1);
        switch (rows) {
            case 1: BLOCK_COUNTS(1) break;
            case 2: BLOCK_COUNTS(2) break;
            case 3: BLOCK_COUNTS(3) break;
            default: BLOCK_COUNTS(4) break;
        }
#undef BLOCK_COUNTS
#undef T
        return;
    }
#endif
    (void)wide;
#define T(R, B) tile_avx2(R, B, p, x, row0, nb0, next_blocks)
    if (rows == 1)
        blocks == 2 ? T(1, 2) : T(1, 1);
    else
        blocks == 2 ? T(2, 2) : T(2, 1);
#undef T
}

/* Column blocks [first, last), all m rows: a chunk of blocks at a time, every row tile
 * over the chunk, so the chunk's weights come from memory once and from L2 after. */
static void int8_blocks(const Problem *p, const Rows *x, int wide, int64_t first, int64_t last) {
    /* One row: one block at a time, one stream. */
    int tile_rows = AVX2_ROWS, tile_blocks = p->m == 1 ? 1 : AVX2_BLOCKS;
#if defined(CHATSVC_INT8_VNNI)
    if (wide && p->m == 1) {
        for (int64_t nb = first; nb < last; nb++) row_vnni(p, x, 0, nb);
        return;
    }
    if (wide) tile_rows = VNNI_ROWS, tile_blocks = VNNI_BLOCKS;
#endif
    int64_t chunk = x->kp ? CHUNK_BYTES / (x->kp * COLS) : last - first;
    chunk = (chunk < tile_blocks ? tile_blocks : chunk) / tile_blocks * tile_blocks;
    for (int64_t start = first; start < last; start += chunk) {
        const int64_t stop = start + chunk < last ? start + chunk : last;
        for (int64_t row0 = 0; row0 < p->m; row0 += tile_rows) {
            const int rows = p->m - row0 < tile_rows ? (int)(p->m - row0) : tile_rows;
            for (int64_t nb = start; nb < stop; nb += tile_blocks) {
                const int blocks = stop - nb < tile_blocks ? (int)(stop - nb) : tile_blocks;
                const int64_t after = last - nb - blocks; /* blocks of the range left after */
                tile_at(p, x, wide, rows, row0, blocks, nb, after < tile_blocks ? after : tile_blocks);
            }
        }
    }
}

int narrow_int8_run(const Problem *p, int wide, int num_threads) {
    const int64_t kp = int8_padded_k(p->k), groups = kp / GROUP;
    const int64_t nbs = (p->n + COLS - 1) / COLS;
    const size_t q_bytes = (size_t)(p->m * kp + 63) / 64 * 64;
    const size_t bytes = q_bytes + (size_t)(p->m * groups) * 8 + 64;
    /* A decode step's few rows on the stack: a heap block per call, 121 calls a step,
     * kept malloc's consolidation busy. */
    char small[SMALL_SCRATCH_BYTES] __attribute__((aligned(64)));
    char *scratch = bytes <= sizeof small ? small : aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!scratch) return -1;
    const Rows x = {kp, groups, (int8_t *)scratch, (float *)(scratch + q_bytes),
                    (int32_t *)(scratch + q_bytes) + p->m * groups};
    for (int64_t r = 0; r < p->m; r++) quantize_row(p, r, &x);
    const int threads = nbs >= 8 ? num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        int8_blocks(p, &x, wide, nbs * t / team, nbs * (t + 1) / team);
    }
    if (scratch != small) free(scratch);
    return 0;
}
#endif
