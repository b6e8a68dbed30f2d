/* The widening loops on AVX2 + FMA (CPUs without AVX-512, as the AMD EPYC): every
 * dtype and int8 caches, K and V widened to fp32 (read in place for fp32). Per 16-key tile and KV
 * head, K is transposed in registers (8x8 shuffles), so a query row's 16 scores are D
 * broadcast multiply-adds into two vectors, with no horizontal sums; two rows of a
 * head share each key load, and each row keeps even and odd dims in separate chains.
 * Then an online softmax in exp2 (a vectorised polynomial), and
 * acc = acc * alpha + p . V with acc in registers, 64 dims at a time.
 *
 * Each row's arithmetic is the same whatever rows share its loads, its tile or its
 * item (kernels/invariance.py): the pairing only saves loads. The AVX-512 twin of this
 * file is attention_avx512.c, the portable one (other CPUs) attention_portable.c; the
 * item walk that calls `tile_head` is attention_walk.h. */

#include "attention_walk.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline __m256 load8_f32(const void *base, int64_t offset, int dtype) {
    if (dtype == DTYPE_F32) return _mm256_loadu_ps((const float *)base + offset);
    if (dtype == DTYPE_INT8) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)((const int8_t *)base + offset));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
    const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + offset));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

/* r[0..8) rows -> columns, in place. */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}

/* 2^x for x <= 0, eight at a time: the scalar exp2_nonpositive's polynomial. */
static inline __m256 exp2_nonpositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(EXP2_TAYLOR[0]);
    for (int c = 1; c < 8; c++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_TAYLOR[c]));
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* K of the tile's n tokens as kt[d * TILE + t] (fp32, zeros past n); the next step's K
 * and V rows (`ahead`) prefetched beside the loads. */
static inline void load_k_transposed(const Args *a, const int64_t *offsets,
                                     const int64_t *ahead, int n, const int D,
                                     float *restrict kt) {
    for (int c = 0; c < D; c += 8)
        for (int half = 0; half < 2; half++) {
            __m256 r[8];
            for (int t = 0; t < 8; t++) {
                const int key = 8 * half + t;
                prefetch_ahead(a, ahead, key, c);
                r[t] = key < n ? load8_f32(a->k, offsets[key] + c, a->kv_dtype) : _mm256_setzero_ps();
            }
            transpose8(r);
            for (int j = 0; j < 8; j++) _mm256_store_ps(kt + (int64_t)(c + j) * TILE + 8 * half, r[j]);
        }
}

/* Scores of R (1 or 2) rows against the transposed tile: out[2j] keys 0-7, out[2j + 1]
 * keys 8-15 of row j, each the sum of an even-dim and an odd-dim chain. */
static inline __attribute__((always_inline)) void scores_rows(const float *const *rows,
                                                              const float *kt, const int D,
                                                              const int R, __m256 *out) {
    __m256 even[2][2], odd[2][2];
    for (int j = 0; j < R; j++)
        even[j][0] = even[j][1] = odd[j][0] = odd[j][1] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 2) {
        const __m256 k00 = _mm256_load_ps(kt + d * TILE), k01 = _mm256_load_ps(kt + d * TILE + 8);
        const __m256 k10 = _mm256_load_ps(kt + (d + 1) * TILE);
        const __m256 k11 = _mm256_load_ps(kt + (d + 1) * TILE + 8);
        for (int j = 0; j < R; j++) {
            const __m256 q0 = _mm256_broadcast_ss(rows[j] + d);
            const __m256 q1 = _mm256_broadcast_ss(rows[j] + d + 1);
            even[j][0] = _mm256_fmadd_ps(q0, k00, even[j][0]);
            even[j][1] = _mm256_fmadd_ps(q0, k01, even[j][1]);
            odd[j][0] = _mm256_fmadd_ps(q1, k10, odd[j][0]);
            odd[j][1] = _mm256_fmadd_ps(q1, k11, odd[j][1]);
        }
    }
    for (int j = 0; j < R; j++) {
        out[2 * j] = _mm256_add_ps(even[j][0], odd[j][0]);
        out[2 * j + 1] = _mm256_add_ps(even[j][1], odd[j][1]);
    }
}

/* acc = acc * alpha + sum_{t < seen} p[t] V[t], 64 dims at a time in registers. */
static inline __attribute__((always_inline)) void accumulate_row(float *acc, float alpha,
                                                                 __m256 p0, __m256 p1, int seen,
                                                                 const float *const *v_rows,
                                                                 const int D) {
    for (int c0 = 0; c0 < D; c0 += 64) {
        const int chunks = (D - c0 < 64 ? D - c0 : 64) / 8;
        __m256 x[8];
        for (int c = 0; c < chunks; c++)
            x[c] = _mm256_mul_ps(_mm256_load_ps(acc + c0 + 8 * c), _mm256_set1_ps(alpha));
        for (int t = 0; t < seen; t++) {
            const __m256 weight =
                _mm256_permutevar8x32_ps(t < 8 ? p0 : p1, _mm256_set1_epi32(t & 7));
            for (int c = 0; c < chunks; c++)
                x[c] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(v_rows[t] + c0 + 8 * c), x[c]);
        }
        for (int c = 0; c < chunks; c++) _mm256_store_ps(acc + c0 + 8 * c, x[c]);
    }
}

/* One key tile of one KV head against the rows of that head. */
static inline __attribute__((always_inline)) void tile_head(
    const Args *a, const Item *it, const ItemState *s, const int64_t *offsets,
    const int64_t *ahead, int32_t first, int n, int h, void *ctx, const int D) {
    (void)ctx;
    const float *q = s->q;
    float *acc = s->acc, *m = s->m, *l = s->l, *kt = s->kt, *v_tile = s->v_tile;
    const int32_t prefix = s->prefix;
    const int q_begin = it->q_begin, q_end = it->q_end;
    const int Hq = a->num_q_heads, G = Hq / a->num_kv_heads;
    const float *v_rows[TILE];
    load_k_transposed(a, offsets, ahead, n, D, kt);
    for (int t = 0; t < n; t++)
        v_rows[t] = row_f32(a->v, offsets[t], D, a->kv_dtype, v_tile + (int64_t)t * D);
    /* int8: the keys' scales multiply their scores, the values' their weights. */
    const int quantized = a->kv_dtype == DTYPE_INT8;
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 k_scale0 = quantized ? _mm256_load_ps(s->ks) : one;
    const __m256 k_scale1 = quantized ? _mm256_load_ps(s->ks + 8) : one;
    const __m256 v_scale0 = quantized ? _mm256_load_ps(s->vs) : one;
    const __m256 v_scale1 = quantized ? _mm256_load_ps(s->vs + 8) : one;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    for (int i = q_begin; i < q_end; i++) {
        int seen = prefix + i - first + 1;
        if (seen <= 0) continue;
        seen = seen > n ? n : seen;
        const __m256 live0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(seen), lanes));
        const __m256 live1 =
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(seen - 8), lanes));
        const int first_row = (i - q_begin) * Hq + h * G;
        for (int g0 = 0; g0 < G; g0 += 2) {
            const int R = G - g0 < 2 ? G - g0 : 2;
            const float *rows[2];
            __m256 scores[4];
            for (int j = 0; j < R; j++) rows[j] = q + (int64_t)(first_row + g0 + j) * D;
            if (R == 2)
                scores_rows(rows, kt, D, 2, scores);
            else
                scores_rows(rows, kt, D, 1, scores);
            for (int j = 0; j < R; j++) {
                const int r = first_row + g0 + j;
                if (quantized) {
                    scores[2 * j] = _mm256_mul_ps(scores[2 * j], k_scale0);
                    scores[2 * j + 1] = _mm256_mul_ps(scores[2 * j + 1], k_scale1);
                }
                const __m256 s0 = _mm256_blendv_ps(minus_inf, scores[2 * j], live0);
                const __m256 s1 = _mm256_blendv_ps(minus_inf, scores[2 * j + 1], live1);
                const float tile_top = hmax8(_mm256_max_ps(s0, s1));
                const float top = tile_top > m[r] ? tile_top : m[r];
                const __m256 t = _mm256_set1_ps(top);
                const __m256 p0 = _mm256_and_ps(live0, exp2_nonpositive8(_mm256_sub_ps(s0, t)));
                const __m256 p1 = _mm256_and_ps(live1, exp2_nonpositive8(_mm256_sub_ps(s1, t)));
                float alpha;
                update_row(top, &m[r], &l[r], hsum8(_mm256_add_ps(p0, p1)), &alpha);
                const __m256 w0 = quantized ? _mm256_mul_ps(p0, v_scale0) : p0;
                const __m256 w1 = quantized ? _mm256_mul_ps(p1, v_scale1) : p1;
                accumulate_row(acc + (int64_t)r * D, alpha, w0, w1, seen, v_rows, D);
            }
        }
    }
}

static const KeyPath WIDENING = {.pairs = 0, .prepare = NULL, .step = tile_head};

void attend_widening(const Args *a, const Item *it, float *scratch, float *partials,
                     int head_dim) {
    walk_head_dims(a, it, scratch, partials, &WIDENING, NULL, head_dim);
}

#endif
