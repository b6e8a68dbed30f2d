/* Paged attention on the CPU, reading K/V blocks where they lie in the pool.
 *
 * The torch path gathers each sequence's blocks into a padded copy per layer
 * and then runs SDPA over the copy; for decodes and short new turns the copy
 * costs as much as the attention. This kernel walks the block table instead:
 *
 *   work item = (sequence, tile of up to q_tile new tokens, slice of its blocks)
 *   rows      = the tile's tokens x all query heads
 *   for each 16-token key tile of the slice, up to the tile's last position, and
 *   each KV head:
 *       scores = rows of the head's GROUP . K[keys, head]^T   (read in place, bf16 -> fp32)
 *       online softmax per row (exp2, scale folded into Q), causal per row
 *       acc    = acc * alpha + P . V[keys, head]
 *   out = acc / l   (or, for a sequence split into slices, partial (m, l, acc)
 *                    merged afterwards: flash-decoding, so one long sequence
 *                    still keeps every thread busy)
 *
 * An item takes all KV heads of a block because a block's K (and V) rows hold
 * every head side by side: one item then reads each cache line once.
 *
 * Sequences whose tables start with the same blocks (a shared system prompt) attend
 * to those blocks together in one item on the tile unit, where it has one, and to
 * the rest on their own; see `plan_shared`.
 *
 * bf16 caches on CPUs with AVX512-BF16 take a second vector path (dot products of
 * bf16 pairs, no widening): see `tile_head_bf16`; where the CPU also has a tile unit
 * (AMX), runs of several new tokens take a third (`tile_head_amx`).
 *
 * Items run in parallel on the caller's OpenMP team (torch's own libgomp,
 * already loaded in the process, so no second team competes for the cores).
 * Sums are fp32; bf16 is widened by a shift and narrowed round-to-nearest-even,
 * as torch does. Inputs are checked by the Python wrapper (kernels/cpu_attention.py):
 * this file trusts its arguments.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_common.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef struct {
    const void *q;
    int64_t q_stride_t, q_stride_h;
    const void *k, *v;
    int64_t kv_stride_block, kv_stride_slot, kv_stride_head;
    void *out;
    int64_t out_stride_t, out_stride_h;
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *query_start, *context_lens;
    int32_t num_q_heads, num_kv_heads, block_size, q_tile, dtype;
    float scale_log2;
} Args;

typedef struct {
    int32_t seq, q_begin, q_end;
    int32_t key_begin, key_end; /* key positions [begin, end), whole blocks */
    int64_t partial;            /* row offset into the partials, -1: write out directly */
    /* A shared-prefix item (see `plan_shared`): the query rows of its tokens, which
     * belong to several sequences; `seq` is one of them. NULL: tokens q_begin..q_end
     * of `seq`. */
    const int32_t *tokens;
} Item;

/* Key tiles are 16 tokens: one fp32 vector of scores per query row. */
enum { TILE = 16 };

/* Row `offset` (elements) of a cache or query tensor as fp32: in place for fp32,
 * widened into `scratch` for bf16. */
static inline const float *row_f32(const void *base, int64_t offset, int n, int dtype,
                                   float *scratch) {
    if (dtype == DTYPE_F32) return (const float *)base + offset;
    const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
    for (int i = 0; i < n; i++) scratch[i] = bf16_to_f32(src[i]);
    return scratch;
}

#if defined(__AVX512F__)
static inline __m512 load16_f32(const void *base, int64_t offset, int dtype) {
    if (dtype == DTYPE_F32) return _mm512_loadu_ps((const float *)base + offset);
    const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* r[0..16) rows -> columns, in place (unpack 32-bit, unpack 64-bit, shuffle 128-bit lanes). */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    /* u[4i + j], 128-bit lane L, holds column 4L + j of rows 4i .. 4i + 3. */
    for (int j = 0; j < 4; j++) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44);
        const __m512 v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
        const __m512 v3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
        r[0 + j] = _mm512_shuffle_f32x4(v0, v2, 0x88);
        r[4 + j] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
        r[8 + j] = _mm512_shuffle_f32x4(v1, v3, 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
    }
}
#endif

/* K of the tile's n tokens as kt[d * TILE + t] (fp32, zeros past n), so a query
 * row's scores are D broadcast-multiply-adds of whole vectors, with no
 * horizontal sums. */
static inline void load_k_transposed(const Args *a, const int64_t *offsets, int n, int D,
                                     float *restrict kt) {
#if defined(__AVX512F__)
    if (D % TILE == 0) {
        for (int c = 0; c < D; c += TILE) {
            __m512 r[TILE];
            for (int t = 0; t < TILE; t++)
                r[t] = t < n ? load16_f32(a->k, offsets[t] + c, a->dtype) : _mm512_setzero_ps();
            transpose16(r);
            for (int j = 0; j < TILE; j++) _mm512_store_ps(kt + (int64_t)(c + j) * TILE, r[j]);
        }
        return;
    }
#endif
    float row[D];
    for (int t = 0; t < TILE; t++) {
        const float *src = t < n ? row_f32(a->k, offsets[t], D, a->dtype, row) : NULL;
        for (int d = 0; d < D; d++) kt[(int64_t)d * TILE + t] = src ? src[d] : 0.0f;
    }
}

/* Both halves of the next block, one cache line at a time, while this one is used. */
static inline void prefetch_block(const Args *a, int64_t block) {
    const int size = a->dtype == DTYPE_F32 ? 4 : 2;
    const int64_t bytes = (int64_t)a->block_size * a->kv_stride_slot * size;
    const char *k = (const char *)a->k + block * size;
    const char *v = (const char *)a->v + block * size;
    for (int64_t b = 0; b < bytes; b += 64) {
        __builtin_prefetch(k + b);
        __builtin_prefetch(v + b);
    }
}

/* Scratch of one thread, in floats: see `attend`. */
static int64_t scratch_floats(int64_t rows, int64_t head_dim) {
    return 2 * rows * head_dim + 2 * rows + 2 * TILE * head_dim;
}


/* Online-softmax update of one query row with one key tile: scores s[0..seen)
 * (already scaled, log2 domain) -> weights p, then acc = acc * alpha + p . V. */
static inline void update_row(float s_top, float *restrict m, float *restrict l, float sum,
                              float *alpha_out) {
    const float alpha = *m == -INFINITY ? 0.0f : exp2_nonpositive(*m - s_top);
    *l = *l * alpha + sum;
    *m = s_top;
    *alpha_out = alpha;
}

#if defined(__AVX512F__)
static inline __m512 exp2_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(EXP2_TAYLOR[0]);
    for (int c = 1; c < 8; c++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_TAYLOR[c]));
    return _mm512_scalef_ps(p, n);
}

/* Scores of R query rows against the transposed key tile: each row keeps two
 * partial sums (even and odd d) and the R rows share every key load, so 2R
 * independent chains of multiply-adds keep the FMA units busy. */
static inline __attribute__((always_inline)) void scores_rows(const float *const *rows,
                                                              const float *kt, const int D,
                                                              const int R, __m512 *out) {
    __m512 even[4], odd[4];
    for (int j = 0; j < R; j++) even[j] = odd[j] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 2) {
        const __m512 k0 = _mm512_load_ps(kt + d * TILE);
        const __m512 k1 = _mm512_load_ps(kt + (d + 1) * TILE);
        for (int j = 0; j < R; j++) {
            even[j] = _mm512_fmadd_ps(_mm512_set1_ps(rows[j][d]), k0, even[j]);
            odd[j] = _mm512_fmadd_ps(_mm512_set1_ps(rows[j][d + 1]), k1, odd[j]);
        }
    }
    for (int j = 0; j < R; j++) out[j] = _mm512_add_ps(even[j], odd[j]);
}

/* acc = acc * alpha + sum_t p[t] V[t]: the D / 16 chunks are independent chains. Each
 * weight is broadcast from the register holding p (a store and scalar reloads would
 * stall on store forwarding). */
static inline __attribute__((always_inline)) void accumulate_row(float *acc, float alpha,
                                                                 __m512 p, int seen,
                                                                 const float *v_tile,
                                                                 const int D) {
    __m512 x[D / 16];
    for (int c = 0; c < D / 16; c++)
        x[c] = _mm512_mul_ps(_mm512_load_ps(acc + 16 * c), _mm512_set1_ps(alpha));
    for (int t = 0; t < seen; t++) {
        const __m512 weight = _mm512_permutexvar_ps(_mm512_set1_epi32(t), p);
        for (int c = 0; c < D / 16; c++)
            x[c] = _mm512_fmadd_ps(weight, _mm512_load_ps(v_tile + t * D + 16 * c), x[c]);
    }
    for (int c = 0; c < D / 16; c++) _mm512_store_ps(acc + 16 * c, x[c]);
}

/* One key tile of one KV head against the rows of that head (AVX-512). */
static inline __attribute__((always_inline)) void tile_head(
    const Args *a, const int64_t *offsets, int n, const int D, const float *q, float *acc,
    float *m, float *l, float *kt, float *v_tile, int32_t prefix, int32_t first, int q_begin,
    int q_end, int h) {
    const int Hq = a->num_q_heads, G = Hq / a->num_kv_heads;
    load_k_transposed(a, offsets, n, D, kt);
    for (int t = 0; t < n; t++)
        for (int c = 0; c < D; c += 16)
            _mm512_store_ps(v_tile + t * D + c, load16_f32(a->v, offsets[t] + c, a->dtype));
    for (int i = q_begin; i < q_end; i++) {
        int seen = prefix + i - first + 1;
        if (seen <= 0) continue;
        seen = seen > n ? n : seen;
        const __mmask16 live = (__mmask16)((1u << seen) - 1u);
        const int first_row = (i - q_begin) * Hq + h * G;
        for (int g0 = 0; g0 < G; g0 += 4) {
            const int R = G - g0 < 4 ? G - g0 : 4;
            const float *rows[4];
            __m512 scores[4];
            for (int j = 0; j < R; j++) rows[j] = q + (int64_t)(first_row + g0 + j) * D;
            switch (R) { /* literal row counts: the row loops unroll into registers */
                case 1: scores_rows(rows, kt, D, 1, scores); break;
                case 2: scores_rows(rows, kt, D, 2, scores); break;
                case 3: scores_rows(rows, kt, D, 3, scores); break;
                default: scores_rows(rows, kt, D, 4, scores); break;
            }
            for (int j = 0; j < R; j++) {
                const int r = first_row + g0 + j;
                const float tile_top = _mm512_mask_reduce_max_ps(live, scores[j]);
                const float top = tile_top > m[r] ? tile_top : m[r];
                const __m512 p = _mm512_maskz_mov_ps(
                    live, exp2_nonpositive16(_mm512_sub_ps(scores[j], _mm512_set1_ps(top))));
                float alpha;
                update_row(top, &m[r], &l[r], _mm512_reduce_add_ps(p), &alpha);
                accumulate_row(acc + (int64_t)r * D, alpha, p, seen, v_tile, D);
            }
        }
    }
}
#else
/* One key tile of one KV head against the rows of that head (portable C). */
static inline __attribute__((always_inline)) void tile_head(
    const Args *a, const int64_t *offsets, int n, const int D, const float *q, float *acc,
    float *m, float *l, float *kt, float *v_tile, int32_t prefix, int32_t first, int q_begin,
    int q_end, int h) {
    const int Hq = a->num_q_heads, G = Hq / a->num_kv_heads;
    const float *v_rows[TILE];
    load_k_transposed(a, offsets, n, D, kt);
    for (int t = 0; t < n; t++)
        v_rows[t] = row_f32(a->v, offsets[t], D, a->dtype, v_tile + (int64_t)t * D);
    for (int i = q_begin; i < q_end; i++) {
        int seen = prefix + i - first + 1;
        if (seen <= 0) continue;
        seen = seen > n ? n : seen;
        for (int g = 0; g < G; g++) {
            const int r = (i - q_begin) * Hq + h * G + g;
            const float *restrict qr = q + (int64_t)r * D;
            float w[TILE] = {0};
            for (int d = 0; d < D; d++) {
                const float *restrict kd = kt + (int64_t)d * TILE;
#pragma omp simd
                for (int t = 0; t < TILE; t++) w[t] += qr[d] * kd[t];
            }
            float top = m[r];
            for (int t = 0; t < seen; t++) top = w[t] > top ? w[t] : top;
            float sum = 0.0f;
            for (int t = 0; t < seen; t++) {
                w[t] = exp2_nonpositive(w[t] - top);
                sum += w[t];
            }
            float alpha;
            update_row(top, &m[r], &l[r], sum, &alpha);
            float *restrict ar = acc + (int64_t)r * D;
#pragma omp simd
            for (int d = 0; d < D; d++) ar[d] *= alpha;
            for (int t = 0; t < seen; t++) {
                const float *restrict vr = v_rows[t];
#pragma omp simd
                for (int d = 0; d < D; d++) ar[d] += w[t] * vr[d];
            }
        }
    }
}
#endif

#if defined(__AVX512BF16__)
/* bf16 caches on CPUs with AVX512-BF16: vdpbf16ps multiplies pairs of bf16 and adds
 * both products to one fp32 lane, so K and V are used as stored (no widening) and
 * a key tile needs half the shuffles of the fp32 path:
 *
 *   scores: K as dword columns (a dword = dims 2i, 2i+1 of one key; 16x16 dword
 *           transposes), each row's dword i broadcast: D/2 dot-pair steps per row.
 *   P.V:    V interleaved by key pairs (unpack of rows t, t+1: dword lane = the
 *           same dim of both keys), the pair's weights broadcast as one dword.
 *
 * The weights are rounded to bf16 for P.V, as the Triton kernels round them for
 * their dot (kernels/decode_attention.py); l sums the rounded weights, so each
 * output row stays a convex combination. Keys go 32 per softmax update (two 16-key
 * tiles), which halves the serial part of a row's update (reductions, alpha) per key.
 * The unpacks work within 128-bit lanes, so acc holds each 32 dims as two vectors
 * of dims {0-3, 8-11, 16-19, 24-27} and {4-7, 12-15, 20-23, 28-31}; rows are put
 * back in order when they leave the item (`unpermute_row`). */

static inline __m512i load_bf16x32(const void *base, int64_t offset) {
    return _mm512_loadu_si512((const uint16_t *)base + offset);
}

/* Dims of acc slot p (see above). */
static inline int acc_dim(int p) {
    const int lane = p % 16;
    return (p / 32) * 32 + (lane / 4) * 8 + ((p / 16) % 2) * 4 + lane % 4;
}

static inline void unpermute_row(const float *acc, float *row, const int D) {
    for (int p = 0; p < D; p++) row[acc_dim(p)] = acc[p];
}

/* kt[(half * D / 2 + i) * 16 + t] (as dwords) = dims (2i, 2i + 1) of key 16 * half + t;
 * zeros past n. The same rows of the next step's keys (`ahead`, -1 past the end) are
 * prefetched between the loads, so their misses overlap this step's work instead of
 * stalling in one burst. */
static inline void load_k_pairs(const Args *a, const int64_t *offsets, const int64_t *ahead,
                                int n, const int D, float *restrict kt) {
    for (int half = 0; half < 2; half++) {
        const int64_t *off = offsets + half * TILE, *next = ahead + half * TILE;
        const int live = n - half * TILE;
        if (live <= 0) { /* zeros: the scores of missing keys are masked, but stay finite */
            memset(kt + (int64_t)half * (D / 2) * TILE, 0, sizeof(float) * (D / 2) * TILE);
            continue;
        }
        for (int c = 0; c < D; c += 32) {
            __m512 r[TILE];
            for (int t = 0; t < TILE; t++) {
                if (next[t] >= 0) {
                    _mm_prefetch((const char *)((const uint16_t *)a->k + next[t] + c), _MM_HINT_T0);
                    _mm_prefetch((const char *)((const uint16_t *)a->v + next[t] + c), _MM_HINT_T0);
                }
                r[t] = t < live ? _mm512_castsi512_ps(load_bf16x32(a->k, off[t] + c))
                                : _mm512_setzero_ps();
            }
            transpose16(r);
            float *dst = kt + ((int64_t)half * (D / 2) + c / 2) * TILE;
            for (int j = 0; j < TILE; j++) _mm512_store_ps(dst + j * TILE, r[j]);
        }
    }
}

/* vv[(k * D / 16 + c) * 16 ..] = chunk c of key pair k (keys 2k, 2k + 1) interleaved;
 * zeros for keys past n. Only the first `pairs` pairs. */
static inline void load_v_pairs(const Args *a, const int64_t *offsets, int n, int pairs,
                                const int D, float *restrict vv) {
    const __m512i zero = _mm512_setzero_si512();
    for (int k = 0; k < pairs; k++) {
        const int t = 2 * k;
        for (int c = 0; c < D; c += 32) {
            const __m512i x = t < n ? load_bf16x32(a->v, offsets[t] + c) : zero;
            const __m512i y = t + 1 < n ? load_bf16x32(a->v, offsets[t + 1] + c) : zero;
            float *dst = vv + ((int64_t)k * (D / 16) + c / 16) * 16;
            _mm512_store_si512(dst, _mm512_unpacklo_epi16(x, y));
            _mm512_store_si512(dst + 16, _mm512_unpackhi_epi16(x, y));
        }
    }
}

/* Scores of R rows (bf16, as dwords) against both halves of the dword columns of K:
 * out[2j + half]. Four chains per row (half x even/odd dims). */
static inline __attribute__((always_inline)) void scores_rows_bf16(
    const uint32_t *const *rows, const float *kt, const int D, const int R, __m512 *out) {
    __m512 even[2][4], odd[2][4];
    for (int half = 0; half < 2; half++)
        for (int j = 0; j < R; j++) even[half][j] = odd[half][j] = _mm512_setzero_ps();
    for (int i = 0; i < D / 2; i += 2) {
        for (int half = 0; half < 2; half++) {
            const float *col = kt + ((int64_t)half * (D / 2) + i) * TILE;
            const __m512bh k0 = (__m512bh)_mm512_load_si512(col);
            const __m512bh k1 = (__m512bh)_mm512_load_si512(col + TILE);
            for (int j = 0; j < R; j++) {
                even[half][j] = _mm512_dpbf16_ps(
                    even[half][j], (__m512bh)_mm512_set1_epi32(rows[j][i]), k0);
                odd[half][j] = _mm512_dpbf16_ps(
                    odd[half][j], (__m512bh)_mm512_set1_epi32(rows[j][i + 1]), k1);
            }
        }
    }
    for (int j = 0; j < R; j++)
        for (int half = 0; half < 2; half++)
            out[2 * j + half] = _mm512_add_ps(even[half][j], odd[half][j]);
}

/* Online-softmax update of one row with the scores of up to 32 keys (raw dot products
 * of keys 0-15 and 16-31; the first `seen` count): returns the weights as 32 bf16
 * (key order), updates m and l with their rounded sum, and sets alpha. */
static inline __m512i softmax_step32(__m512 raw0, __m512 raw1, int seen, float scale_log2,
                                     float *m, float *l, float *alpha) {
    const uint32_t live = seen >= 32 ? 0xffffffffu : (1u << seen) - 1u;
    const __mmask16 live0 = (__mmask16)live, live1 = (__mmask16)(live >> 16);
    const __m512 scale = _mm512_set1_ps(scale_log2), minus_inf = _mm512_set1_ps(-INFINITY);
    const __m512 s0 = _mm512_mask_mov_ps(minus_inf, live0, _mm512_mul_ps(raw0, scale));
    const __m512 s1 = _mm512_mask_mov_ps(minus_inf, live1, _mm512_mul_ps(raw1, scale));
    const float step_top = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
    const float top = step_top > *m ? step_top : *m;
    const __m512 t = _mm512_set1_ps(top);
    const __m512 p0 = _mm512_maskz_mov_ps(live0, exp2_nonpositive16(_mm512_sub_ps(s0, t)));
    const __m512 p1 = _mm512_maskz_mov_ps(live1, exp2_nonpositive16(_mm512_sub_ps(s1, t)));
    const __m512i p = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
    /* The weights P.V will use, widened back for their sum. */
    const __m512 lo = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(p)), 16));
    const __m512 hi = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(p, 1)), 16));
    update_row(top, m, l, _mm512_reduce_add_ps(_mm512_add_ps(lo, hi)), alpha);
    return p;
}

/* acc = acc * alpha + sum over key pairs of (p[2k], p[2k+1]) . V pair k. */
static inline __attribute__((always_inline)) void accumulate_row_bf16(
    float *acc, float alpha, __m512i p_bf16, int pairs, const float *vv, const int D) {
    __m512 x[D / 16];
    for (int c = 0; c < D / 16; c++)
        x[c] = _mm512_mul_ps(_mm512_load_ps(acc + 16 * c), _mm512_set1_ps(alpha));
    for (int k = 0; k < pairs; k++) {
        const __m512bh w = (__m512bh)_mm512_permutexvar_epi32(_mm512_set1_epi32(k), p_bf16);
        for (int c = 0; c < D / 16; c++)
            x[c] = _mm512_dpbf16_ps(
                x[c], w, (__m512bh)_mm512_load_si512(vv + ((int64_t)k * (D / 16) + c) * 16));
    }
    for (int c = 0; c < D / 16; c++) _mm512_store_ps(acc + 16 * c, x[c]);
}

/* One step of up to 2 x 16 keys of one KV head against the rows of that head (bf16,
 * AVX512-BF16). */
static inline __attribute__((always_inline)) void tile_head_bf16(
    const Args *a, const int64_t *offsets, const int64_t *ahead, int n, const int D,
    const uint16_t *q, float *acc, float *m, float *l, float *kt, float *vv, int32_t prefix,
    int32_t first, int q_begin, int q_end, int h) {
    const int Hq = a->num_q_heads, G = Hq / a->num_kv_heads;
    /* The last row sees the most keys of the step. */
    int most = prefix + (q_end - 1) - first + 1;
    most = most > n ? n : most;
    load_k_pairs(a, offsets, ahead, n, D, kt);
    load_v_pairs(a, offsets, n, (most + 1) / 2, D, vv);
    for (int i = q_begin; i < q_end; i++) {
        int seen = prefix + i - first + 1;
        if (seen <= 0) continue;
        seen = seen > n ? n : seen;
        const int first_row = (i - q_begin) * Hq + h * G;
        for (int g0 = 0; g0 < G; g0 += 4) {
            const int R = G - g0 < 4 ? G - g0 : 4;
            const uint32_t *rows[4];
            __m512 scores[8];
            for (int j = 0; j < R; j++)
                rows[j] = (const uint32_t *)(q + (int64_t)(first_row + g0 + j) * D);
            switch (R) { /* literal row counts: the row loops unroll into registers */
                case 1: scores_rows_bf16(rows, kt, D, 1, scores); break;
                case 2: scores_rows_bf16(rows, kt, D, 2, scores); break;
                case 3: scores_rows_bf16(rows, kt, D, 3, scores); break;
                default: scores_rows_bf16(rows, kt, D, 4, scores); break;
            }
            for (int j = 0; j < R; j++) {
                const int r = first_row + g0 + j;
                float alpha;
                const __m512i p = softmax_step32(scores[2 * j], scores[2 * j + 1], seen,
                                                 a->scale_log2, &m[r], &l[r], &alpha);
                accumulate_row_bf16(acc + (int64_t)r * D, alpha, p, (seen + 1) / 2, vv, D);
            }
        }
    }
}
#endif

#if defined(CHATSVC_AMX)
/* Runs of several new tokens on CPUs with AMX. One tile instruction multiplies
 * 16 x 32 bf16 by 32 x 16 bf16 into 16 x 16 fp32, so the rows of one KV head (its
 * query heads x the tile's new tokens, up to 16) get their scores and P.V from the
 * tile unit and only the softmax runs in vector code. K and V come in the bf16
 * path's layouts, which are the tile unit's B operands as they are (kt: dword
 * columns for Q.K^T; vv: key pairs for P.V), so acc keeps that path's dim order.
 * A decode alone has G rows per head (3 for SmolLM2): it stays on the vector path,
 * which wastes no tile rows, except for the keys it shares (`plan_shared`). */

enum { AMX_ROWS = 16, AMX_MIN_ROWS = 6 };

/* Floats of a thread's tile scratch: per KV head its rows packed [16][D] (bf16),
 * scores [16][32], weights [16][32] (bf16), P.V [16][D], alpha [16]. */
static int64_t amx_scratch_floats(int64_t num_kv_heads, int64_t head_dim) {
    return num_kv_heads * AMX_ROWS * head_dim / 2 + AMX_ROWS * 32 + AMX_ROWS * 16 +
           AMX_ROWS * head_dim + AMX_ROWS;
}

/* One step of up to 32 keys of one KV head against its `nrows` packed rows `qh`
 * (row j = token q_begin + j / G, query head h * G + j % G). */
static inline __attribute__((always_inline)) void tile_head_amx(
    const Args *a, const int64_t *offsets, const int64_t *ahead, int n, const int D,
    const uint16_t *qh, int nrows, float *acc, float *m, float *l, float *kt, float *vv,
    float *tiles, int32_t prefix, int32_t first, int q_begin, int h) {
    const int Hq = a->num_q_heads, G = Hq / a->num_kv_heads;
    float *scores = tiles, *out = scores + AMX_ROWS * 32 + AMX_ROWS * 16;
    uint16_t *weights = (uint16_t *)(scores + AMX_ROWS * 32);
    float *alphas = out + AMX_ROWS * D;
    int most = prefix + q_begin + (nrows - 1) / G - first + 1;
    most = most > n ? n : most;
    load_k_pairs(a, offsets, ahead, n, D, kt);
    load_v_pairs(a, offsets, n, (most + 1) / 2, D, vv);

    /* S = Q K^T, keys 0-15 in tile 0 and 16-31 in tile 1. */
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < D; c += 32) {
        _tile_loadd(2, qh + c, D * 2);
        _tile_loadd(4, kt + (c / 2) * TILE, TILE * 4);
        _tile_dpbf16ps(0, 2, 4);
        _tile_loadd(5, kt + (D / 2 + c / 2) * TILE, TILE * 4);
        _tile_dpbf16ps(1, 2, 5);
    }
    _tile_stored(0, scores, 32 * 4);
    _tile_stored(1, scores + TILE, 32 * 4);

    for (int j = 0; j < nrows; j++) {
        const int token = q_begin + j / G, r = (j / G) * Hq + h * G + j % G;
        int seen = prefix + token - first + 1;
        if (seen <= 0) { /* every key of the step lies after this row's token */
            memset(weights + j * 32, 0, 64);
            alphas[j] = 1.0f;
            continue;
        }
        seen = seen > n ? n : seen;
        const __m512i p =
            softmax_step32(_mm512_load_ps(scores + j * 32), _mm512_load_ps(scores + j * 32 + 16),
                           seen, a->scale_log2, &m[r], &l[r], &alphas[j]);
        _mm512_store_si512(weights + j * 32, p);
    }

    /* P.V per 16 dims (in acc's order), then acc = acc * alpha + P.V per row. */
    _tile_loadd(2, weights, 64);
    for (int c = 0; c < D / 16; c++) {
        _tile_zero(6);
        _tile_loadd(4, vv + c * 16, D * 4);
        _tile_dpbf16ps(6, 2, 4);
        _tile_stored(6, out + c * 16, D * 4);
    }
    for (int j = 0; j < nrows; j++) {
        float *ar = acc + (int64_t)((j / G) * Hq + h * G + j % G) * D;
        const __m512 alpha = _mm512_set1_ps(alphas[j]);
        for (int c = 0; c < D; c += 16)
            _mm512_store_ps(ar + c, _mm512_fmadd_ps(_mm512_load_ps(ar + c), alpha,
                                                    _mm512_load_ps(out + j * D + c)));
    }
}
#endif

/* One work item. `D` and `dot_pairs` are literals at the call sites below, so each
 * head size and path gets its own fully unrolled copy; dot_pairs: 0 the widening
 * loops, 1 the bf16 dot-pair loops, 2 those with the tile unit (`amx`: the thread's
 * tile scratch). Row r = token (i - q_begin) * H_q + query head.
 * Scratch (floats, 64-byte aligned pieces as D is a multiple of 16):
 * q[rows * D] acc[rows * D] kt[TILE * D] v_tile[TILE * D] m[rows] l[rows]. */
static inline __attribute__((always_inline)) void attend(const Args *a, const Item *it,
                                                         float *scratch, float *partials,
                                                         float *amx, const int D,
                                                         const int dot_pairs) {
    const int Hq = a->num_q_heads, bs = a->block_size;
    const int32_t start = a->query_start[it->seq];
    const int32_t q_len = a->query_start[it->seq + 1] - start;
    const int32_t prefix = a->context_lens[it->seq] - q_len;
    const int rows = (it->q_end - it->q_begin) * Hq;

    float *q = scratch;
    float *acc = q + (int64_t)rows * D;
    float *kt = acc + (int64_t)rows * D;
    float *v_tile = kt + (int64_t)TILE * D;
    float *m = v_tile + (int64_t)TILE * D;
    float *l = m + rows;
    int64_t offsets[2 * TILE], next[2 * TILE];

    for (int r = 0; r < rows; r++) {
        const int i = it->q_begin + r / Hq, head = r % Hq;
        const int64_t token = it->tokens ? it->tokens[i] : start + i;
        const int64_t offset = token * a->q_stride_t + (int64_t)head * a->q_stride_h;
        if (dot_pairs) { /* bf16 as given; the scale applies to the scores */
            memcpy((uint16_t *)q + (int64_t)r * D, (const uint16_t *)a->q + offset, 2 * D);
        } else {
            const float *src = row_f32(a->q, offset, D, a->dtype, q + (int64_t)r * D);
#pragma omp simd
            for (int d = 0; d < D; d++) q[(int64_t)r * D + d] = src[d] * a->scale_log2;
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma omp simd
        for (int d = 0; d < D; d++) acc[(int64_t)r * D + d] = 0.0f;
    }

#if defined(CHATSVC_AMX)
    /* The tile unit takes the item when each KV head has enough rows to fill a tile. */
    const int G = Hq / a->num_kv_heads, nrows = (it->q_end - it->q_begin) * G;
    const int use_amx = dot_pairs == 2;
    uint16_t *qh = (uint16_t *)amx;
    float *tiles = amx + (int64_t)a->num_kv_heads * AMX_ROWS * D / 2;
    if (use_amx) {
        /* Zeros: the unused tile rows, and V pairs no step has loaded yet (weight 0
         * times whatever is there must stay 0). */
        memset(amx, 0, sizeof(float) * amx_scratch_floats(a->num_kv_heads, D));
        memset(v_tile, 0, sizeof(float) * TILE * D);
        for (int h = 0; h < a->num_kv_heads; h++)
            for (int j = 0; j < nrows; j++)
                memcpy(qh + ((int64_t)h * AMX_ROWS + j) * D,
                       (const uint16_t *)q + (int64_t)((j / G) * Hq + h * G + j % G) * D, 2 * D);
    }
#endif

    /* The tile's last row sees keys [0, last]; earlier rows stop sooner (causal). */
    const int32_t last = prefix + it->q_end - 1;
    const int32_t stop = last + 1 < it->key_end ? last + 1 : it->key_end;
    const int32_t *table = a->block_tables + (int64_t)it->seq * a->table_stride;
    const int step = dot_pairs ? 2 * TILE : TILE;
    for (int32_t first = it->key_begin; first < stop; first += step) {
        const int n = stop - first < step ? stop - first : step;
        const int32_t ahead = first + (bs > TILE ? bs : TILE);
        if (!dot_pairs && ahead < stop && (first & (bs - 1)) == 0)
            prefetch_block(a, (int64_t)table[ahead / bs] * a->kv_stride_block);
        for (int h = 0; h < a->num_kv_heads; h++) {
            for (int t = 0; t < n; t++) {
                const int32_t pos = first + t;
                offsets[t] = (int64_t)table[pos / bs] * a->kv_stride_block +
                             (int64_t)(pos & (bs - 1)) * a->kv_stride_slot +
                             (int64_t)h * a->kv_stride_head;
            }
#if defined(__AVX512BF16__)
            if (dot_pairs) {
                for (int t = 0; t < 2 * TILE; t++) {
                    const int32_t pos = first + step + t;
                    next[t] = pos >= stop ? -1
                                          : (int64_t)table[pos / bs] * a->kv_stride_block +
                                                (int64_t)(pos & (bs - 1)) * a->kv_stride_slot +
                                                (int64_t)h * a->kv_stride_head;
                }
#if defined(CHATSVC_AMX)
                if (use_amx) {
                    tile_head_amx(a, offsets, next, n, D, qh + (int64_t)h * AMX_ROWS * D, nrows,
                                  acc, m, l, kt, v_tile, tiles, prefix, first, it->q_begin, h);
                    continue;
                }
#endif
                tile_head_bf16(a, offsets, next, n, D, (const uint16_t *)q, acc, m, l, kt, v_tile,
                               prefix, first, it->q_begin, it->q_end, h);
                continue;
            }
#endif
            tile_head(a, offsets, n, D, q, acc, m, l, kt, v_tile, prefix, first, it->q_begin,
                      it->q_end, h);
        }
    }

    float ordered[D];
    for (int r = 0; r < rows; r++) {
        const float *ar = acc + (int64_t)r * D;
#if defined(__AVX512BF16__)
        if (dot_pairs) {
            unpermute_row(ar, ordered, D);
            ar = ordered;
        }
#endif
        if (it->partial >= 0) {
            float *dst = partials + (it->partial + r) * (D + 2);
            dst[0] = m[r];
            dst[1] = l[r];
            memcpy(dst + 2, ar, sizeof(float) * D);
            continue;
        }
        const int i = it->q_begin + r / Hq, head = r % Hq;
        const float inv = 1.0f / l[r]; /* l >= 1: a row always sees its own key */
        const int64_t offset =
            (int64_t)(start + i) * a->out_stride_t + (int64_t)head * a->out_stride_h;
        if (a->dtype == DTYPE_F32) {
            float *dst = (float *)a->out + offset;
#pragma omp simd
            for (int d = 0; d < D; d++) dst[d] = ar[d] * inv;
        } else {
            uint16_t *dst = (uint16_t *)a->out + offset;
#pragma omp simd
            for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(ar[d] * inv);
        }
    }
}

#if defined(CHATSVC_AMX)
/* Its own function: inlined beside the others, its frame made decodes ~5 % slower. */
static __attribute__((noinline)) void attend_tiles(const Args *a, const Item *it,
                                                   float *scratch, float *partials, float *amx,
                                                   int head_dim) {
    switch (head_dim) {
        case 64: attend(a, it, scratch, partials, amx, 64, 2); break;
        case 128: attend(a, it, scratch, partials, amx, 128, 2); break;
        default: attend(a, it, scratch, partials, amx, head_dim, 2); break;
    }
}
#endif

static void attend_any(const Args *a, const Item *it, float *scratch, float *partials,
                       float *amx, int head_dim) {
#if defined(__AVX512BF16__)
    if (a->dtype == DTYPE_BF16 && head_dim % 32 == 0) {
        /* 2: the tile path (see `attend`), a literal like D so that decodes get a copy
         * without it. */
        int path = 1;
#if defined(CHATSVC_AMX)
        const int nrows = (it->q_end - it->q_begin) * (a->num_q_heads / a->num_kv_heads);
        if (amx && nrows >= AMX_MIN_ROWS && nrows <= AMX_ROWS) path = 2;
#endif
        if (path == 2) {
#if defined(CHATSVC_AMX)
            attend_tiles(a, it, scratch, partials, amx, head_dim);
#endif
            return;
        }
        switch (head_dim) {
            case 64: attend(a, it, scratch, partials, NULL, 64, 1); break;
            case 128: attend(a, it, scratch, partials, NULL, 128, 1); break;
            default: attend(a, it, scratch, partials, NULL, head_dim, 1); break;
        }
        return;
    }
#endif
    switch (head_dim) {
        case 64: attend(a, it, scratch, partials, NULL, 64, 0); break;
        case 128: attend(a, it, scratch, partials, NULL, 128, 0); break;
        default: attend(a, it, scratch, partials, NULL, head_dim, 0); break;
    }
}

/* A tile of one sequence's new tokens and where its pieces' partial states lie:
 * row r of piece p at partials[(parts[first_part + p] + r) * (D + 2)]. */
typedef struct {
    int32_t seq, q_begin, q_end;
    int32_t first_part, num_parts;
} Tile;

/* Merge the pieces of one tile: out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p. */
static void merge(const Args *a, const Tile *tile, const int64_t *parts, const float *partials,
                  int head_dim) {
    const int Hq = a->num_q_heads, D = head_dim;
    const int32_t start = a->query_start[tile->seq];
    const int rows = (tile->q_end - tile->q_begin) * Hq;
    const int64_t *own = parts + tile->first_part;
    float acc[D];
    for (int r = 0; r < rows; r++) {
        float top = -INFINITY;
        for (int p = 0; p < tile->num_parts; p++) {
            const float mp = partials[(own[p] + r) * (D + 2)];
            top = mp > top ? mp : top;
        }
        float total = 0.0f;
        for (int d = 0; d < D; d++) acc[d] = 0.0f;
        for (int p = 0; p < tile->num_parts; p++) {
            const float *part = partials + (own[p] + r) * (D + 2);
            if (part[1] == 0.0f) continue; /* the piece lies wholly after this row */
            const float w = exp2_nonpositive(part[0] - top);
            total += w * part[1];
#pragma omp simd
            for (int d = 0; d < D; d++) acc[d] += w * part[2 + d];
        }
        const int i = tile->q_begin + r / Hq, head = r % Hq;
        const int64_t offset =
            (int64_t)(start + i) * a->out_stride_t + (int64_t)head * a->out_stride_h;
        const float inv = 1.0f / total;
        if (a->dtype == DTYPE_F32) {
            float *dst = (float *)a->out + offset;
            for (int d = 0; d < D; d++) dst[d] = acc[d] * inv;
        } else {
            uint16_t *dst = (uint16_t *)a->out + offset;
            for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(acc[d] * inv);
        }
    }
}

/* Blocks per slice at least, when a sequence is split (below that, the merge
 * costs more than the idle thread would). */
enum { MIN_SLICE_BLOCKS = 16 };

/* Shared prefixes. Sequences whose block tables start with the same blocks (one
 * system prompt, the forks of n > 1) read the same keys there. Up to a tile's worth
 * of their new tokens (16 rows per KV head) then attend to those keys together, as
 * one item on the tile unit, and each sequence attends to the rest of its context
 * on its own; the two partial states are merged like slices:
 *
 *   keys   | 0 ........... S | S ............ context |
 *   seq a  | shared item     | own items of a        |  -> merge
 *   seq b  |  (a + b + ...)  | own items of b        |  -> merge
 *
 * A decode alone fills 3 of a tile's 16 rows (SmolLM2); five decodes sharing a
 * system prompt fill 15, and their prompt costs the tile unit one pass instead of
 * five vector passes. Only where tiles are in use (bf16 with AMX): on vector
 * loops the sum of work is the same either way. A sequence joins when all its new
 * tokens fit the item and the shared keys lie wholly before them. */
enum { MIN_SHARED_KEYS = 64 };

typedef struct {
    int32_t leader;        /* batch index whose table the item reads */
    int32_t shared_blocks; /* S / block_size */
    int32_t num_members;
    int32_t num_tokens;    /* members' new tokens */
    int32_t target;        /* tokens it takes: its class's tokens spread evenly, <= cap */
} SharedGroup;

#if defined(CHATSVC_AMX)
/* Number of leading equal block ids of two tables, at most `limit`. */
static int32_t common_blocks(const int32_t *x, const int32_t *y, int32_t limit) {
    int32_t n = 0;
    while (n < limit && x[n] == y[n]) n++;
    return n;
}

/* Whether seqs[s] may share: a run that fits one item, after enough whole blocks. */
static int may_share(const int32_t *query_start, const int32_t *context_lens, int32_t b,
                     int32_t block_size, int32_t cap, int32_t min_blocks) {
    const int32_t q_len = query_start[b + 1] - query_start[b];
    return q_len >= 1 && q_len <= cap && (context_lens[b] - q_len) / block_size >= min_blocks;
}

/* Assign sequences to shared groups: group[s] for seqs[s], -1 for none. Returns the
 * number of groups with at least two members (the rest are dissolved). Sequences
 * that start with the same block are spread evenly over as few items as hold
 * their tokens (16 decodes of 3 rows: 4 items of 4, not 5 + 5 + 5 + 1 left alone).
 * `scratch`: num_seqs ints. */
static int32_t plan_shared(const int32_t *block_tables, int64_t table_stride,
                           const int32_t *query_start, const int32_t *context_lens,
                           const int32_t *seqs, int32_t num_seqs, int32_t block_size,
                           int32_t cap, SharedGroup *groups, int32_t *group, int32_t *scratch) {
    const int32_t min_blocks = (MIN_SHARED_KEYS + block_size - 1) / block_size;
    int32_t num_groups = 0;
    for (int32_t s = 0; s < num_seqs; s++) {
        group[s] = -1;
        const int32_t b = seqs[s];
        if (!may_share(query_start, context_lens, b, block_size, cap, min_blocks)) continue;
        const int32_t q_len = query_start[b + 1] - query_start[b];
        const int32_t visible = (context_lens[b] - q_len) / block_size;
        const int32_t *table = block_tables + (int64_t)b * table_stride;
        for (int32_t g = 0; g < num_groups && group[s] < 0; g++) {
            SharedGroup *sg = &groups[g];
            if (sg->num_tokens + q_len > sg->target) continue;
            const int32_t limit = visible < sg->shared_blocks ? visible : sg->shared_blocks;
            const int32_t common = common_blocks(
                table, block_tables + (int64_t)sg->leader * table_stride, limit);
            /* The second member sets the shared keys (the leader alone holds its whole
             * prefix); later ones may shorten them, but not below half. */
            if (common < min_blocks || (sg->num_members > 1 && 2 * common < sg->shared_blocks))
                continue;
            sg->shared_blocks = common;
            sg->num_members++;
            sg->num_tokens += q_len;
            group[s] = g;
        }
        if (group[s] < 0) {
            /* The tokens of every sequence starting with this block, and so the size
             * of this class's items. */
            int32_t total = 0;
            for (int32_t t = s; t < num_seqs; t++) {
                const int32_t c = seqs[t];
                if (block_tables[(int64_t)c * table_stride] == table[0] &&
                    may_share(query_start, context_lens, c, block_size, cap, min_blocks))
                    total += query_start[c + 1] - query_start[c];
            }
            const int32_t items = (total + cap - 1) / cap;
            groups[num_groups] = (SharedGroup){b, visible, 1, q_len, (total + items - 1) / items};
            group[s] = num_groups++;
        }
    }
    /* Keep groups of two or more, renumbered. */
    for (int32_t g = 0; g < num_groups; g++) scratch[g] = 0;
    for (int32_t s = 0; s < num_seqs; s++)
        if (group[s] >= 0) scratch[group[s]]++;
    int32_t kept = 0;
    for (int32_t g = 0; g < num_groups; g++) {
        if (scratch[g] >= 2) {
            groups[kept] = groups[g];
            scratch[g] = kept++;
        } else {
            scratch[g] = -1;
        }
    }
    for (int32_t s = 0; s < num_seqs; s++)
        if (group[s] >= 0) group[s] = scratch[group[s]];
    return kept;
}
#endif

/* Attention of the new tokens of sequences `seqs[0..num_seqs)` (indices into the
 * batch); rows of other sequences in `out` are left untouched. Strides are in
 * elements; K and V share theirs. Returns 0, or -1 when scratch memory runs out
 * (nothing is then written). */
int chatsvc_paged_attention(const void *q, int64_t q_stride_t, int64_t q_stride_h,
                            const void *k, const void *v, int64_t kv_stride_block,
                            int64_t kv_stride_slot, int64_t kv_stride_head, void *out,
                            int64_t out_stride_t, int64_t out_stride_h,
                            const int32_t *block_tables, int64_t table_stride,
                            const int32_t *query_start, const int32_t *context_lens,
                            const int32_t *seqs, int32_t num_seqs, int32_t num_q_heads,
                            int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                            int32_t q_tile, float scale_log2, int32_t dtype,
                            int32_t num_threads) {
    if (num_seqs <= 0) return 0;
    int amx_on = 0;
    int32_t num_groups = 0;
    SharedGroup *groups = calloc((size_t)num_seqs, sizeof(SharedGroup));
    int32_t *group = malloc(sizeof(int32_t) * num_seqs);
    int32_t *scratch_ids = malloc(sizeof(int32_t) * num_seqs);
    if (!groups || !group || !scratch_ids) {
        free(groups);
        free(group);
        free(scratch_ids);
        return -1;
    }
    for (int32_t s = 0; s < num_seqs; s++) group[s] = -1;
#if defined(CHATSVC_AMX)
    const int32_t G = num_q_heads / num_kv_heads;
    if (dtype == DTYPE_BF16 && head_dim % 32 == 0 && AMX_ROWS / G >= 1 && amx_usable()) {
        /* A tile holds 16 rows per KV head: the tile's new tokens x G. Threads set up
         * tiles only for a call that has a run long enough, or a shared prefix, to use
         * them (a lone decode's 3 rows would waste the setup). */
        const int32_t fits = AMX_ROWS / G;
        const int32_t cap = q_tile < fits ? q_tile : fits;
        for (int32_t s = 0; s < num_seqs && !amx_on; s++) {
            const int32_t q_len = query_start[seqs[s] + 1] - query_start[seqs[s]];
            amx_on = (q_len < fits ? q_len : fits) * G >= AMX_MIN_ROWS;
        }
        num_groups = plan_shared(block_tables, table_stride, query_start, context_lens, seqs,
                                 num_seqs, block_size, cap, groups, group, scratch_ids);
        for (int32_t g = 0; g < num_groups && !amx_on; g++)
            amx_on = groups[g].num_tokens * G >= AMX_MIN_ROWS;
        if (amx_on && q_tile > fits) q_tile = fits;
    }
#endif
    free(scratch_ids);
    const Args a = {q, q_stride_t, q_stride_h, k, v, kv_stride_block, kv_stride_slot,
                    kv_stride_head, out, out_stride_t, out_stride_h, block_tables, table_stride,
                    query_start, context_lens, num_q_heads, num_kv_heads, block_size, q_tile,
                    dtype, scale_log2};
    int64_t num_tiles = 0, num_tokens = 0;
    for (int32_t s = 0; s < num_seqs; s++) {
        const int32_t q_len = query_start[seqs[s] + 1] - query_start[seqs[s]];
        num_tiles += (q_len + q_tile - 1) / q_tile;
        num_tokens += q_len;
    }
    if (num_tiles == 0) {
        free(groups);
        free(group);
        return 0;
    }
    /* Split tiles into slices only when there are too few tiles to share out. */
    const int64_t want = num_tiles >= 2 * num_threads ? 1 : (4 * num_threads + num_tiles - 1) / num_tiles;
    /* Each tile becomes at most `want` items, plus a piece of its group's shared item. */
    Item *items = malloc(sizeof(Item) * (num_tiles * want + num_groups + 1));
    Tile *tiles = malloc(sizeof(Tile) * (num_tiles + 1));
    int64_t *parts = malloc(sizeof(int64_t) * (num_tiles * (want + 1) + 1));
    int32_t *shared_tokens = malloc(sizeof(int32_t) * (num_tokens + 1));
    int64_t *shared_offset = calloc((size_t)num_groups + 1, sizeof(int64_t));
    if (!items || !tiles || !parts || !shared_tokens || !shared_offset) {
        free(items);
        free(tiles);
        free(parts);
        free(shared_tokens);
        free(shared_offset);
        free(groups);
        free(group);
        return -1;
    }
    int64_t n = 0, partial_rows = 0, num_parts = 0;
    /* Shared items first: their tokens and partial rows. A member's token t of the
     * item is row (shared_offset + t * Hq + head) in the partials. */
    int32_t filled = 0;
    for (int32_t g = 0; g < num_groups; g++) {
        Item it = {groups[g].leader, 0, 0, 0, groups[g].shared_blocks * block_size,
                   partial_rows, shared_tokens + filled};
        for (int32_t s = 0; s < num_seqs; s++) {
            if (group[s] != g) continue;
            for (int32_t t = query_start[seqs[s]]; t < query_start[seqs[s] + 1]; t++)
                shared_tokens[filled++] = t;
        }
        it.q_end = groups[g].num_tokens;
        shared_offset[g] = partial_rows;
        partial_rows += (int64_t)it.q_end * num_q_heads;
        items[n++] = it;
    }
    int64_t tile = 0;
    int32_t member_token[num_groups + 1];
    for (int32_t g = 0; g < num_groups; g++) member_token[g] = 0;
    for (int32_t s = 0; s < num_seqs; s++) {
        const int32_t b = seqs[s], g = group[s];
        const int32_t q_len = query_start[b + 1] - query_start[b];
        const int32_t key_begin = g >= 0 ? groups[g].shared_blocks * block_size : 0;
        const int32_t blocks = (context_lens[b] + block_size - 1) / block_size - key_begin / block_size;
        int64_t slices = blocks / MIN_SLICE_BLOCKS;
        slices = slices < 1 ? 1 : slices > want ? want : slices;
        const int32_t per_slice = (int32_t)((blocks + slices - 1) / slices) * block_size;
        const int split = slices > 1 || g >= 0;
        for (int32_t begin = 0; begin < q_len; begin += q_tile) {
            const int32_t end = begin + q_tile < q_len ? begin + q_tile : q_len;
            Tile *t = &tiles[tile++];
            *t = (Tile){b, begin, end, (int32_t)num_parts, 0};
            if (g >= 0) /* a member has all its tokens in one tile (q_len <= cap) */
                parts[num_parts++] = shared_offset[g] + (int64_t)(member_token[g] + begin) * num_q_heads;
            for (int64_t p = 0; p < slices; p++) {
                Item it = {b, begin, end, key_begin + (int32_t)p * per_slice,
                           key_begin + (int32_t)(p + 1) * per_slice, -1, NULL};
                if (split) {
                    it.partial = partial_rows;
                    parts[num_parts++] = partial_rows;
                    partial_rows += (int64_t)(end - begin) * num_q_heads;
                }
                items[n++] = it;
            }
            t->num_parts = (int32_t)num_parts - t->first_part;
        }
        if (g >= 0) member_token[g] += q_len;
    }
    const int64_t num_items = n;

    float *partials = partial_rows ? malloc(sizeof(float) * partial_rows * (head_dim + 2)) : NULL;
    const int64_t rows = (int64_t)q_tile * num_q_heads;
    const int64_t scratch_bytes =
        ((scratch_floats(rows, head_dim) * (int64_t)sizeof(float) + 63) / 64) * 64;
    int failed = partial_rows && !partials;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = aligned_alloc(64, scratch_bytes);
        float *amx = NULL;
#if defined(CHATSVC_AMX)
        if (amx_on) {
            const int64_t bytes = amx_scratch_floats(num_kv_heads, head_dim) * 4;
            amx = aligned_alloc(64, ((bytes + 63) / 64) * 64);
            if (amx) amx_configure();
        }
#endif
        if (!scratch || (amx_on && !amx)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < num_items; i++)
                attend_any(&a, &items[i], scratch, partials, amx, head_dim);
            if (partial_rows) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t t = 0; t < num_tiles; t++)
                    if (tiles[t].num_parts > 1) merge(&a, &tiles[t], parts, partials, head_dim);
            }
        }
#if defined(CHATSVC_AMX)
        if (amx) _tile_release();
#endif
        free(amx);
        free(scratch);
    }
    free(partials);
    free(shared_offset);
    free(shared_tokens);
    free(parts);
    free(tiles);
    free(items);
    free(groups);
    free(group);
    return failed ? -1 : 0;
}

/* 1 when runs of new tokens in bf16 (head size a multiple of 32) go through the tile
 * unit, 0 when they take the vector loops: the Python side routes longer runs here
 * in the first case (kernels/cpu_attention.py: native_max_query). */
int chatsvc_attention_uses_tiles(void) { return amx_usable(); }
