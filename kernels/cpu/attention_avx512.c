/* The widening loops on AVX-512: every dtype, int8 caches, and bf16 where the CPU has
 * no AVX512-BF16 (or the item is one the dot-pair path does not take). Per 16-key tile
 * and KV head, K is widened to fp32 and transposed in registers (16x16 shuffles), so
 * a query row's 16 scores are D broadcast multiply-adds with no horizontal sums (up
 * to four rows of a head share each key load); an online softmax in exp2; then
 * acc = acc * alpha + p . V in D / 16 independent chains, V read in place for fp32 and
 * widened once per tile otherwise. The portable twin of this file is
 * attention_portable.c; the item walk that calls `tile_head` is attention_walk.h. */

#include "attention_walk.h"

#if defined(__AVX512F__)

static inline __m512 load16_f32(const void *base, int64_t offset, int dtype) {
    if (dtype == DTYPE_F32) return _mm512_loadu_ps((const float *)base + offset);
    if (dtype == DTYPE_INT8) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)((const int8_t *)base + offset));
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
    }
    const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

/* K of the tile's n tokens as kt[d * TILE + t] (fp32, zeros past n), so a query
 * row's scores are D broadcast-multiply-adds of whole vectors, with no
 * horizontal sums; the next step's K and V rows (`ahead`) prefetched beside the loads. */
static inline void load_k_transposed(const Args *a, const int64_t *offsets,
                                     const int64_t *ahead, int n, int D, float *restrict kt) {
    if (D % TILE == 0) {
        for (int c = 0; c < D; c += TILE) {
            __m512 r[TILE];
            for (int t = 0; t < TILE; t++) {
                prefetch_ahead(a, ahead, t, c);
                r[t] = t < n ? load16_f32(a->k, offsets[t] + c, a->kv_dtype) : _mm512_setzero_ps();
            }
            transpose16(r);
            for (int j = 0; j < TILE; j++) _mm512_store_ps(kt + (int64_t)(c + j) * TILE, r[j]);
        }
        return;
    }
    float row[D];
    for (int t = 0; t < TILE; t++) {
        for (int c = 0; c < D; c++) prefetch_ahead(a, ahead, t, c);
        const float *src = t < n ? row_f32(a->k, offsets[t], D, a->kv_dtype, row) : NULL;
        for (int d = 0; d < D; d++) kt[(int64_t)d * TILE + t] = src ? src[d] : 0.0f;
    }
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
                                                                 const float *const *v_rows,
                                                                 const int D) {
    __m512 x[D / 16];
    for (int c = 0; c < D / 16; c++)
        x[c] = _mm512_mul_ps(_mm512_load_ps(acc + 16 * c), _mm512_set1_ps(alpha));
    for (int t = 0; t < seen; t++) {
        const __m512 weight = _mm512_permutexvar_ps(_mm512_set1_epi32(t), p);
        for (int c = 0; c < D / 16; c++)
            x[c] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(v_rows[t] + 16 * c), x[c]);
    }
    for (int c = 0; c < D / 16; c++) _mm512_store_ps(acc + 16 * c, x[c]);
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
    load_k_transposed(a, offsets, ahead, n, D, kt);
    /* V's rows: fp32 read where they lie, other dtypes widened once for all rows. */
    const float *v_rows[TILE];
    for (int t = 0; t < n; t++) {
        if (a->kv_dtype == DTYPE_F32) {
            v_rows[t] = (const float *)a->v + offsets[t];
            continue;
        }
        for (int c = 0; c < D; c += 16)
            _mm512_store_ps(v_tile + t * D + c, load16_f32(a->v, offsets[t] + c, a->kv_dtype));
        v_rows[t] = v_tile + t * D;
    }
    /* int8: the keys' scales multiply their scores, the values' their weights. */
    const int quantized = a->kv_dtype == DTYPE_INT8;
    const __m512 k_scale = quantized ? _mm512_load_ps(s->ks) : _mm512_set1_ps(1.0f);
    const __m512 v_scale = quantized ? _mm512_load_ps(s->vs) : _mm512_set1_ps(1.0f);
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
                if (quantized) scores[j] = _mm512_mul_ps(scores[j], k_scale);
                const float tile_top = _mm512_mask_reduce_max_ps(live, scores[j]);
                const float top = tile_top > m[r] ? tile_top : m[r];
                const __m512 p = _mm512_maskz_mov_ps(
                    live, exp2_nonpositive16(_mm512_sub_ps(scores[j], _mm512_set1_ps(top))));
                float alpha;
                update_row(top, &m[r], &l[r], _mm512_reduce_add_ps(p), &alpha);
                const __m512 weights = quantized ? _mm512_mul_ps(p, v_scale) : p;
                accumulate_row(acc + (int64_t)r * D, alpha, weights, seen, v_rows, D);
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
