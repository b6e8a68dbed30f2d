/* int8 caches read by bf16 queries on CPUs with AVX512-VNNI (`attend_byte_dots`):
 * integer dot products on the bytes as stored, no widening of K or V to floats.
 *
 *   scores: each query row quantized once per item, symmetric int8 with a scale per
 *           row (as the cache quantizes a key: max |q| / 127, round-half-even), and
 *           dotted with the keys' bytes by vpdpbusd (4 dims per dword; K as loaded,
 *           put in order by unpacks within 128-bit lanes, the lanes' partial sums
 *           added once per 16 keys and row: `score_head_rows`). vpdpbusd takes
 *           one operand unsigned, so the keys go in biased by 128 and the row's
 *           128 * sum(q) comes off the exact int32 sum. A score is then
 *           float(sum) * (the row's scale * the key's scale).
 *   P.V:    the 32 weights of a step times their values' scales, quantized to
 *           unsigned bytes against the step's largest (8 bits: each weight within
 *           1/510 of the largest, the bf16 weights' error for the weights that count),
 *           V as stored, interleaved by key quads (one dword = one dim of 4 keys),
 *           vpdpbusd into int32 (4 keys per instruction), times the step's unit into
 *           acc. l sums the weights themselves (fp32).
 *
 * Integer sums are exact, so a row's result depends only on its own query, its keys
 * and the fixed 32-key steps of its span: the batch and cache-state invariance of the
 * float paths holds. Against the float64 oracle a query's rounding to int8 moves a
 * score by at most half its step times the key's L1 norm, the size of the cache's own
 * rounding of the key (tests/kernels/test_kv_int8.py). Overflow: |q| <= 127 and a
 * biased key byte <= 255 over 256 dims stay under 2^23; 32 weights <= 255 times
 * |v| <= 127 under 2^21.
 *
 * The acc dim order is the bf16 pair paths' (attention.h): the quads' sums
 * are permuted into it once per row and step (`add_quad_sums`). */

#include "attention_walk.h"

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)

/* An item's quantized query rows: after its bf16 rows in the q scratch, which holds
 * rows * D floats (the bf16 rows fill half of it): q [rows][D] int8, then per row its
 * scale and 128 * sum(q). */
typedef struct {
    int8_t *q;
    float *scale;
    int32_t *bias;
} QueryBytes;

static inline QueryBytes query_bytes(const ItemState *s, const int D) {
    char *base = (char *)s->q + (int64_t)s->rows * D * 2;
    QueryBytes b;
    b.q = (int8_t *)base;
    b.scale = (float *)(base + (int64_t)s->rows * D);
    b.bias = (int32_t *)(b.scale + s->rows);
    return b;
}

/* Once per item: every query row to int8 with its scale, 16 dims at a time (D is a
 * multiple of 32 here). NaN in a row gives a NaN scale, so its scores stay NaN as in the
 * float paths. */
static void quantize_queries(const Args *a, const Item *it, const ItemState *s, void *ctx,
                             const int D) {
    (void)ctx;
    const QueryBytes b = query_bytes(s, D);
    const uint16_t *q = (const uint16_t *)s->q;
    const __m512 limit = _mm512_set1_ps(127.0f);
    const int Hq = a->num_q_heads, G = Hq / a->num_kv_heads;
    for (int r = 0; r < s->rows; r++) {
        const int kv_head = (r % Hq) / G; /* an item cut by KV head reads its heads' rows only */
        if (kv_head < it->head_begin || kv_head >= it->head_end) continue;
        const uint16_t *row = q + (int64_t)r * D;
        __m512 x[D / 16], amax = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (int c = 0; c < D / 16; c++) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(row + 16 * c));
            x[c] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            amax = _mm512_max_ps(amax, _mm512_abs_ps(x[c]));
            nan |= _mm512_cmp_ps_mask(x[c], x[c], _CMP_UNORD_Q);
        }
        const float scale = nan ? __builtin_nanf("") : _mm512_reduce_max_ps(amax) / 127.0f;
        __m512i sum = _mm512_setzero_si512();
        int8_t *dst = b.q + (int64_t)r * D;
        for (int c = 0; c < D / 16; c++) {
            __m512 v = _mm512_setzero_ps();
            if (scale > 0.0f) { /* x / scale (an exact division, as the scalar one), rounded half even */
                v = _mm512_roundscale_ps(_mm512_div_ps(x[c], _mm512_set1_ps(scale)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v = _mm512_max_ps(_mm512_min_ps(v, limit), _mm512_sub_ps(_mm512_setzero_ps(), limit));
            }
            const __m512i words = _mm512_cvtps_epi32(v);
            sum = _mm512_add_epi32(sum, words);
            _mm_storeu_si128((__m128i *)(dst + 16 * c), _mm512_cvtepi32_epi8(words));
        }
        b.scale[r] = scale;
        b.bias[r] = 128 * _mm512_reduce_add_epi32(sum);
    }
}

/* The rows of KV head h whose integer scores one K pass computes: 128 bytes each (32
 * keys) in the K tile's scratch of TILE * D floats. */
static inline int score_rows_cap(const int D) { return D / 2; }

/* Integer scores (the row's 128 * sum(q) still on) of `count` rows of KV head h from
 * head row k0 (head row k = token q_begin + k / G, query head h * G + k % G) against
 * the step's n keys: sc[(k - k0) * 32 + t] for key t, zeros past n.
 *
 * No transpose of K leaves the 128-bit lanes: per 4 keys, two rounds of in-lane unpacks
 * give vector j with dword 4L + j of the 4 keys in lane L; a row's dword 4L + j,
 * broadcast within lane L, dotted with it (vpdpbusd) and summed over j leaves each key
 * 4 partial sums, one per lane, added across lanes once per 16 keys and row. The sums
 * are exact integers, so they are the same whichever way they are grouped. Keys go in
 * biased by 128 (vpdpbusd's unsigned operand). `prefetch`: also fetch the next step's
 * rows, as `load_k_pairs` does. */
static inline __attribute__((always_inline)) void score_head_rows(
    const Args *a, const QueryBytes *b, const int64_t *offsets, const int64_t *ahead, int n,
    int h, int k0, int count, int prefetch, int32_t *restrict sc, const int D) {
    const int Hq = a->num_q_heads, G = Hq / a->num_kv_heads;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int half = 0; half < 2; half++) {
        const int64_t *off = offsets + half * TILE, *next = ahead + half * TILE;
        const int live = n - half * TILE;
        if (live <= 0) { /* masked scores, but defined */
            for (int k = 0; k < count; k++)
                _mm512_store_si512(sc + k * 32 + half * TILE, _mm512_setzero_si512());
            continue;
        }
        for (int c = 0; c < D; c += 64) {
            const int bytes = D - c < 64 ? D - c : 64;
            const __mmask64 mask = bytes == 64 ? ~(__mmask64)0 : ((__mmask64)1 << bytes) - 1;
            __m512i lanes[TILE]; /* [4 * quad + j] */
            for (int quad = 0; quad < 4; quad++) {
                __m512i r[4];
                for (int i = 0; i < 4; i++) {
                    const int t = 4 * quad + i;
                    if (prefetch && next[t] >= 0) {
                        prefetch_kv((const char *)a->k + next[t] + c);
                        prefetch_kv((const char *)a->v + next[t] + c);
                    }
                    r[i] = t < live ? _mm512_xor_si512(
                                          _mm512_maskz_loadu_epi8(mask, (const int8_t *)a->k + off[t] + c),
                                          bias)
                                    : _mm512_setzero_si512();
                }
                const __m512i lo01 = _mm512_unpacklo_epi32(r[0], r[1]), hi01 = _mm512_unpackhi_epi32(r[0], r[1]);
                const __m512i lo23 = _mm512_unpacklo_epi32(r[2], r[3]), hi23 = _mm512_unpackhi_epi32(r[2], r[3]);
                lanes[4 * quad + 0] = _mm512_unpacklo_epi64(lo01, lo23);
                lanes[4 * quad + 1] = _mm512_unpackhi_epi64(lo01, lo23);
                lanes[4 * quad + 2] = _mm512_unpacklo_epi64(hi01, hi23);
                lanes[4 * quad + 3] = _mm512_unpackhi_epi64(hi01, hi23);
            }
            for (int k = 0; k < count; k++) {
                const int row = (k0 + k) / G * Hq + h * G + (k0 + k) % G;
                const __m512i q = _mm512_maskz_loadu_epi8(mask, b->q + (int64_t)row * D + c);
                const __m512i qj[4] = {_mm512_shuffle_epi32(q, 0x00), _mm512_shuffle_epi32(q, 0x55),
                                       _mm512_shuffle_epi32(q, 0xAA), _mm512_shuffle_epi32(q, 0xFF)};
                __m512i part[4]; /* per quad: lane L, dword p = key 4 quad + p over dims of lane L */
                for (int quad = 0; quad < 4; quad++) {
                    part[quad] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lanes[4 * quad], qj[0]);
                    for (int j = 1; j < 4; j++)
                        part[quad] = _mm512_dpbusd_epi32(part[quad], lanes[4 * quad + j], qj[j]);
                }
                /* Lanes summed: dword 4 quad + p of the result = key 4 quad + p. */
                const __m512i s01 = _mm512_add_epi32(_mm512_shuffle_i32x4(part[0], part[1], 0x44),
                                                     _mm512_shuffle_i32x4(part[0], part[1], 0xEE));
                const __m512i s23 = _mm512_add_epi32(_mm512_shuffle_i32x4(part[2], part[3], 0x44),
                                                     _mm512_shuffle_i32x4(part[2], part[3], 0xEE));
                __m512i sum = _mm512_add_epi32(_mm512_shuffle_i32x4(s01, s23, 0x88),
                                               _mm512_shuffle_i32x4(s01, s23, 0xDD));
                int32_t *dst = sc + k * 32 + half * TILE;
                if (c > 0) sum = _mm512_add_epi32(sum, _mm512_load_si512(dst));
                _mm512_store_si512(dst, sum);
            }
        }
    }
}

/* Dims rounded up to whole 64-byte rows: the quads' layout works in 64 dims. */
static inline int quad_dims(const int D) { return (D + 63) / 64 * 64; }

/* vq[(k * P / 16 + 4 * (c / 64) + j) * 16 + 4 * L + p] (bytes in dword order) = dim
 * c + 16 L + 4 j + p of keys 4k .. 4k + 3, one byte each (P = quad_dims(D)); zeros past n
 * and past D. Only `quads` quads. */
static inline void load_v_quads(const Args *a, const int64_t *offsets, int n, int quads,
                                const int D, int32_t *restrict vq) {
    const int8_t *v = (const int8_t *)a->v;
    const int P = quad_dims(D);
    for (int k = 0; k < quads; k++) {
        for (int c = 0; c < D; c += 64) {
            const int bytes = D - c < 64 ? D - c : 64;
            const __mmask64 mask = bytes == 64 ? ~(__mmask64)0 : ((__mmask64)1 << bytes) - 1;
            __m512i r[4];
            for (int i = 0; i < 4; i++)
                r[i] = 4 * k + i < n ? _mm512_maskz_loadu_epi8(mask, v + offsets[4 * k + i] + c)
                                     : _mm512_setzero_si512();
            /* Bytes of keys (0, 1) and (2, 3) side by side, then the two pairs: within
             * each 128-bit lane, as the unpacks work. */
            const __m512i lo01 = _mm512_unpacklo_epi8(r[0], r[1]), hi01 = _mm512_unpackhi_epi8(r[0], r[1]);
            const __m512i lo23 = _mm512_unpacklo_epi8(r[2], r[3]), hi23 = _mm512_unpackhi_epi8(r[2], r[3]);
            int32_t *dst = vq + ((int64_t)k * (P / 16) + c / 16) * 16;
            _mm512_store_si512(dst, _mm512_unpacklo_epi16(lo01, lo23));
            _mm512_store_si512(dst + 16, _mm512_unpackhi_epi16(lo01, lo23));
            _mm512_store_si512(dst + 32, _mm512_unpacklo_epi16(hi01, hi23));
            _mm512_store_si512(dst + 48, _mm512_unpackhi_epi16(hi01, hi23));
        }
    }
}

/* The degree of exp2's series for the weights: they go on to 8 bits (each within 1/510
 * of the step's largest), so 4.2e-5 of relative error (degree 4) is lost in that
 * rounding, and three fewer FMAs per 16 keys and row are 5 % of the walk (Zen 4). l sums
 * the same weights, so a row stays a convex combination. */
enum { EXP_DEGREE = 4 };

/* Online-softmax update of one row with the scores of up to 32 keys, as `softmax_step32`
 * except the weights: p times the values' scales `vs`, returned as 32 unsigned bytes of
 * `*unit` each (key order, 4 to a dword: dword k = quad k); l sums p itself. */
static inline __attribute__((always_inline)) __m512i softmax_step32_bytes(
    __m512 raw0, __m512 raw1, int seen, float scale_log2, float *m, float *l, float *alpha,
    const float *vs, float *unit) {
    __m512 p0, p1;
    const float top = softmax_weights32(raw0, raw1, seen, scale_log2, *m, &p0, &p1, EXP_DEGREE);
    update_row(top, m, l, _mm512_reduce_add_ps(_mm512_add_ps(p0, p1)), alpha);
    const __m512 w0 = _mm512_mul_ps(p0, _mm512_load_ps(vs));
    const __m512 w1 = _mm512_mul_ps(p1, _mm512_load_ps(vs + 16));
    const float most = _mm512_reduce_max_ps(_mm512_max_ps(w0, w1));
    if (!(most > 0.0f)) { /* every weight 0 (or NaN, which l carries to the output) */
        *unit = 0.0f;
        return _mm512_setzero_si512();
    }
    const __m512 to_bytes = _mm512_set1_ps(255.0f / most);
    const __m512i top_byte = _mm512_set1_epi32(255);
    const __m512i q0 = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(w0, to_bytes)), top_byte);
    const __m512i q1 = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(w1, to_bytes)), top_byte);
    *unit = most / 255.0f;
    const __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(q0)),
                                                  _mm512_cvtepi32_epi8(q1), 1);
    return _mm512_castsi256_si512(bytes);
}

/* acc = acc * alpha + unit * sums, the quads' int32 sums `x` (4 vectors per 64 dims,
 * `load_v_quads` order) put into the pair order: each 32 dims of acc take lanes 0-1
 * (then 2-3) of x[0], x[2] (A) and of x[1], x[3] (B). */
static inline __attribute__((always_inline)) void add_quad_sums(float *acc, float alpha,
                                                                const __m512i *x, float unit,
                                                                const int D) {
    const __m512i first = pair_lanes_index(0), second = pair_lanes_index(1);
    const __m512 u = _mm512_set1_ps(unit), keep = _mm512_set1_ps(alpha);
    for (int g = 0; g < D / 32; g++) { /* 32 dims: two acc vectors */
        const __m512i *w = x + 4 * (g / 2);
        const __m512i index = g % 2 ? second : first;
        const __m512i sums[2] = {_mm512_permutex2var_epi32(w[0], index, w[2]),
                                 _mm512_permutex2var_epi32(w[1], index, w[3])};
        for (int half = 0; half < 2; half++) {
            float *dst = acc + 32 * g + 16 * half;
            _mm512_store_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[half]), u,
                                                 _mm512_mul_ps(_mm512_load_ps(dst), keep)));
        }
    }
}

/* For each of R rows: acc = acc * alpha + unit * (sum over key quads of the quad's
 * bytes . V quad k). The rows go together: each quad of V is loaded once for all of
 * them, and their chains of dot products interleave. */
static inline __attribute__((always_inline)) void accumulate_rows_bytes(
    float *const *acc, const float *alpha, const __m512i *bytes, const float *unit, int quads,
    const int32_t *vq, const int D, const int R) {
    const int P = quad_dims(D);
    /* Fixed sizes (head sizes up to 256: kernels/backend.py): with literal R and D the
     * compiler keeps them in registers, where a VLA of vectors lived on the stack. */
    __m512i x[4][16];
    for (int j = 0; j < R; j++)
        for (int c = 0; c < P / 16; c++) x[j][c] = _mm512_setzero_si512();
    for (int k = 0; k < quads; k++) {
        const __m512i at = _mm512_set1_epi32(k);
        __m512i v[16];
        for (int c = 0; c < P / 16; c++)
            v[c] = _mm512_load_si512(vq + ((int64_t)k * (P / 16) + c) * 16);
        for (int j = 0; j < R; j++) {
            const __m512i w = _mm512_permutexvar_epi32(at, bytes[j]);
            for (int c = 0; c < P / 16; c++) x[j][c] = _mm512_dpbusd_epi32(x[j][c], w, v[c]);
        }
    }
    for (int j = 0; j < R; j++) add_quad_sums(acc[j], alpha[j], x[j], unit[j], D);
}

/* One step of R (<= 4) rows of one query token and KV head, from their integer scores
 * `sc` (32 per row): the softmax update, then P.V against vq, each stage for all R rows
 * before the next. */
static inline __attribute__((always_inline)) void rows_step_bytes(
    const Args *a, const ItemState *s, const QueryBytes *b, const int32_t *sc,
    const int32_t *vq, int first_row, int seen, const int D, const int R) {
    __m512i bytes[4];
    float *acc[4], alpha[4], unit[4];
    const __m512 k_scale0 = _mm512_load_ps(s->ks), k_scale1 = _mm512_load_ps(s->ks + TILE);
    for (int j = 0; j < R; j++) {
        const int r = first_row + j;
        const __m512i bias = _mm512_set1_epi32(b->bias[r]);
        const __m512 row_scale = _mm512_set1_ps(b->scale[r]);
        const __m512i sum0 = _mm512_load_si512(sc + 32 * j), sum1 = _mm512_load_si512(sc + 32 * j + TILE);
        const __m512 raw0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum0, bias)),
                                          _mm512_mul_ps(k_scale0, row_scale));
        const __m512 raw1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum1, bias)),
                                          _mm512_mul_ps(k_scale1, row_scale));
        bytes[j] = softmax_step32_bytes(raw0, raw1, seen, a->scale_log2, &s->m[r], &s->l[r],
                                        &alpha[j], s->vs, &unit[j]);
        acc[j] = s->acc + (int64_t)r * D;
    }
    const int quads = (seen + 3) / 4;
    if (R * (quad_dims(D) / 16) <= 16) { /* the rows' sums fit in registers together */
        accumulate_rows_bytes(acc, alpha, bytes, unit, quads, vq, D, R);
    } else {
        for (int j = 0; j < R; j++)
            accumulate_rows_bytes(&acc[j], &alpha[j], &bytes[j], &unit[j], quads, vq, D, 1);
    }
}

/* One step of up to 2 x 16 keys of one KV head against the rows of that head: their
 * scores in passes of up to `score_rows_cap` rows (one pass for a decode or a few
 * tokens), each pass's rows then in groups of up to 4 of one token. */
static inline __attribute__((always_inline)) void tile_head_bytes(
    const Args *a, const Item *it, const ItemState *s, const int64_t *offsets,
    const int64_t *ahead, int32_t first, int n, int h, void *ctx, const int D) {
    (void)ctx;
    const QueryBytes b = query_bytes(s, D);
    int32_t *sc = (int32_t *)s->kt; /* score_rows_cap(D) rows of 32 */
    int32_t *vq = (int32_t *)s->v_tile; /* 32 * quad_dims(D) bytes: inside TILE * D floats */
    const int32_t prefix = s->prefix;
    const int q_begin = it->q_begin, q_end = it->q_end;
    const int Hq = a->num_q_heads, G = Hq / a->num_kv_heads;
    const int rows = (q_end - q_begin) * G, cap = score_rows_cap(D);
    /* The last row sees the most keys of the step. */
    int most = prefix + (q_end - 1) - first + 1;
    most = most > n ? n : most;
    for (int k0 = 0; k0 < rows; k0 += cap) {
        const int count = rows - k0 < cap ? rows - k0 : cap;
        score_head_rows(a, &b, offsets, ahead, n, h, k0, count, k0 == 0, sc, D);
        /* V after K: its rows, prefetched a step ago, are loaded later in the step, and
         * wait less (docs/benchmarks.md, int8 KV). */
        if (k0 == 0) load_v_quads(a, offsets, n, (most + 3) / 4, D, vq);
        for (int k = k0; k < k0 + count;) {
            const int i = q_begin + k / G, g = k % G;
            int R = G - g < 4 ? G - g : 4;
            R = k0 + count - k < R ? k0 + count - k : R;
            int seen = prefix + i - first + 1;
            seen = seen > n ? n : seen;
            if (seen > 0) {
                const int32_t *own = sc + (k - k0) * 32;
                const int first_row = (i - q_begin) * Hq + h * G + g;
                switch (R) { /* literal row counts: the row loops unroll into registers */
                    case 1: rows_step_bytes(a, s, &b, own, vq, first_row, seen, D, 1); break;
                    case 2: rows_step_bytes(a, s, &b, own, vq, first_row, seen, D, 2); break;
                    case 3: rows_step_bytes(a, s, &b, own, vq, first_row, seen, D, 3); break;
                    default: rows_step_bytes(a, s, &b, own, vq, first_row, seen, D, 4); break;
                }
            }
            k += R;
        }
    }
}

static const KeyPath BYTE_DOTS = {.pairs = 1, .prepare = quantize_queries, .step = tile_head_bytes};

void attend_byte_dots(const Args *a, const Item *it, float *scratch, float *partials,
                      int head_dim) {
    walk_head_dims(a, it, scratch, partials, &BYTE_DOTS, NULL, head_dim);
}

#endif
