/* The widening loops in portable C: builds whose target has neither AVX-512 nor AVX2
 * with FMA (elsewhere than x86, or -mno-avx2). K and V rows are widened to fp32 (in place
 * for fp32; an int8 cache's scales applied to the scores and the weights),
 * K transposed per 16-key tile so a row's scores are plain vector loops the compiler
 * vectorises, then the online softmax and acc = acc * alpha + p . V per row. The
 * AVX-512 twin of this file is attention_avx512.c; the item walk that calls
 * `tile_head` is attention_walk.h. */

#include "attention_walk.h"

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))

/* K of the tile's n tokens as kt[d * TILE + t] (fp32, zeros past n), so a query
 * row's scores are D multiply-adds of whole tiles, with no horizontal sums; the next
 * step's K and V rows (`ahead`) prefetched row by row. */
static inline void load_k_transposed(const Args *a, const int64_t *offsets,
                                     const int64_t *ahead, int n, int D, float *restrict kt) {
    float row[D];
    for (int t = 0; t < TILE; t++) {
        for (int c = 0; c < D; c++) prefetch_ahead(a, ahead, t, c);
        const float *src = t < n ? row_f32(a->k, offsets[t], D, a->kv_dtype, row) : NULL;
        for (int d = 0; d < D; d++) kt[(int64_t)d * TILE + t] = src ? src[d] : 0.0f;
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
            if (quantized)
                for (int t = 0; t < TILE; t++) w[t] *= s->ks[t];
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
                const float weight = quantized ? w[t] * s->vs[t] : w[t];
#pragma omp simd
                for (int d = 0; d < D; d++) ar[d] += weight * vr[d];
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
