/* bf16 caches on CPUs with AVX512-BF16, decodes and the runs the tile unit does not take:
 * products of bf16 pairs (vdpbf16ps) into fp32 lanes, K and V used as stored (int8
 * caches take the byte dots of attention_int8.c).
 * The layouts (K as dword columns, V by key pairs), the 32-key softmax step and the
 * dim order of acc are described in attention.h, which the tile path
 * (attention_amx.c) shares. */

#include "attention_walk.h"

#if defined(__AVX512BF16__)

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

/* One step of up to 2 x 16 keys of one KV head against the rows of that head. */
static inline __attribute__((always_inline)) void tile_head_bf16(
    const Args *a, const Item *it, const ItemState *s, const int64_t *offsets,
    const int64_t *ahead, int32_t first, int n, int h, void *ctx, const int D) {
    (void)ctx;
    const uint16_t *q = (const uint16_t *)s->q;
    float *acc = s->acc, *m = s->m, *l = s->l, *kt = s->kt, *vv = s->v_tile;
    const int32_t prefix = s->prefix;
    const int q_begin = it->q_begin, q_end = it->q_end;
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
                const __m512i p =
                    softmax_step32(scores[2 * j], scores[2 * j + 1], seen, a->scale_log2, &m[r],
                                   &l[r], &alpha);
                accumulate_row_bf16(acc + (int64_t)r * D, alpha, p, (seen + 1) / 2, vv, D);
            }
        }
    }
}

static const KeyPath DOT_PAIRS = {.pairs = 1, .prepare = NULL, .step = tile_head_bf16};

void attend_dot_pairs(const Args *a, const Item *it, float *scratch, float *partials,
                      int head_dim) {
    walk_head_dims(a, it, scratch, partials, &DOT_PAIRS, NULL, head_dim);
}

#endif
