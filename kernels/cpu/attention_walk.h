/* The walk of one work item over its keys, written once for the attention's paths
 * (attention_portable.c, _avx512.c, _bf16.c, _amx.c):
 *
 *   item_begin                       the item's scratch and its query rows
 *   for each step of keys            16 keys (widening loops) or 32 (pair paths)
 *     prefetch_scales                an int8 cache's scales of the next step
 *     for each KV head
 *       item_offsets                 where the step's rows of this head lie
 *       item_scales                  their scales, for an int8 cache
 *       item_offsets_ahead           the next step's rows, which the path's loads
 *                                    prefetch as they go (prefetch_ahead)
 *       path->step                   the path's own loop over the step's keys
 *   item_end                         the output rows, or the item's partial states
 *
 * A path is a `KeyPath`: its step function, what it does once per item before the
 * keys (`prepare`), and whether it is a pair path. The path files pass a `static const
 * KeyPath` to `walk_head_dims`; everything here is always_inline, so the path's
 * functions are constants where the walk lands and the compiler inlines them into it,
 * as if each file had its own copy of the walk. */

#ifndef CHATSVC_CPU_ATTENTION_WALK_H
#define CHATSVC_CPU_ATTENTION_WALK_H

#include "attention.h"

/* An int8 cache's scales of the `keys` keys from position `first` (none from `stop`
 * on), one cache line at a time: they lie apart from the rows, in their block's slabs. */
static inline void prefetch_scales(const Args *a, const int32_t *table, int32_t first,
                                   int32_t stop, int keys) {
    const int bs = a->block_size;
    const int64_t line = 32; /* bf16 scales per cache line */
    for (int32_t pos = first; pos < first + keys && pos < stop;) {
        int32_t end = (pos | (bs - 1)) + 1; /* this block's keys end here */
        end = end < first + keys ? end : first + keys;
        end = end < stop ? end : stop;
        const int64_t base = (int64_t)table_block(table, pos, bs) * a->scale_stride_block;
        const int64_t lo = base + (int64_t)(pos & (bs - 1)) * a->scale_stride_slot;
        const int64_t hi = base + (int64_t)((end - 1) & (bs - 1)) * a->scale_stride_slot +
                           (int64_t)(a->num_kv_heads - 1) * a->scale_stride_head;
        for (int64_t at = lo; at < hi + line; at += line) {
            prefetch_kv(a->k_scale + (at < hi ? at : hi));
            prefetch_kv(a->v_scale + (at < hi ? at : hi));
        }
        pos = end;
    }
}

/* One item's working state. Scratch of one thread (floats, 64-byte aligned pieces as
 * D is a multiple of 16): q[rows * D] acc[rows * D] kt[TILE * D] v_tile[TILE * D]
 * ks[2 * TILE] vs[2 * TILE] m[rows] l[rows]. Row r = token (i - q_begin) * H_q + query
 * head. ks, vs: an int8 cache's scales of the step's keys for the head at hand. */
typedef struct {
    int32_t start;  /* the sequence's first query row */
    int32_t prefix; /* its tokens before the new ones */
    int32_t stop;   /* keys the item reads end here: its last row's position + 1, capped */
    int rows;
    const int32_t *table;
    float *q, *acc, *kt, *v_tile, *ks, *vs, *m, *l;
} ItemState;

/* Lay out the item's scratch and load its query rows: as fp32 times the scale
 * (`raw_bf16` 0: the widening loops) or as the bf16 they are (1: the dot-pair and
 * tile paths, which scale the scores). m = -inf, l = 0, acc = 0. */
static inline __attribute__((always_inline)) ItemState item_begin(const Args *a, const Item *it,
                                                                  float *scratch, const int D,
                                                                  const int raw_bf16) {
    const int Hq = a->num_q_heads;
    ItemState s;
    s.start = a->query_start[it->seq];
    const int32_t q_len = a->query_start[it->seq + 1] - s.start;
    s.prefix = a->context_lens[it->seq] - q_len;
    s.rows = (it->q_end - it->q_begin) * Hq;
    s.table = a->block_tables + (int64_t)it->seq * a->table_stride;
    s.q = scratch;
    s.acc = s.q + (int64_t)s.rows * D;
    s.kt = s.acc + (int64_t)s.rows * D;
    s.v_tile = s.kt + (int64_t)TILE * D;
    s.ks = s.v_tile + (int64_t)TILE * D;
    s.vs = s.ks + 2 * TILE;
    s.m = s.vs + 2 * TILE;
    s.l = s.m + s.rows;
    for (int r = 0; r < s.rows; r++) {
        const int i = it->q_begin + r / Hq, head = r % Hq;
        const int64_t token = it->tokens ? it->tokens[i] : s.start + i;
        const int64_t offset = token * a->q_stride_t + (int64_t)head * a->q_stride_h;
        if (raw_bf16) {
            memcpy((uint16_t *)s.q + (int64_t)r * D, (const uint16_t *)a->q + offset, 2 * D);
        } else {
            const float *src = row_f32(a->q, offset, D, a->dtype, s.q + (int64_t)r * D);
#pragma omp simd
            for (int d = 0; d < D; d++) s.q[(int64_t)r * D + d] = src[d] * a->scale_log2;
        }
        s.m[r] = -INFINITY;
        s.l[r] = 0.0f;
#pragma omp simd
        for (int d = 0; d < D; d++) s.acc[(int64_t)r * D + d] = 0.0f;
    }
    /* The tile's last row sees keys [0, last]; earlier rows stop sooner (causal). */
    const int32_t last = s.prefix + it->q_end - 1;
    s.stop = last + 1 < it->key_end ? last + 1 : it->key_end;
    return s;
}

/* Element offsets of KV head h's rows for the n keys from position `first`. */
static inline __attribute__((always_inline)) void item_offsets(const Args *a,
                                                               const int32_t *table,
                                                               int32_t first, int n, int h,
                                                               int64_t *offsets) {
    const int bs = a->block_size;
    for (int t = 0; t < n; t++) {
        const int32_t pos = first + t;
        offsets[t] = (int64_t)table_block(table, pos, bs) * a->kv_stride_block +
                     (int64_t)(pos & (bs - 1)) * a->kv_stride_slot +
                     (int64_t)h * a->kv_stride_head;
    }
}

#if defined(__AVX512F__)
/* The scales of KV head h for `live` (<= 16) keys of one block from `slot`, as fp32,
 * zeros past them: each gathered as the dword that ends with it, whose high half is its
 * fp32 bits (the element before it lies in the pool too: the scales follow the rows). */
static inline __m512 gather_scales16(const uint16_t *scales, const Args *a, int64_t block,
                                     int slot, int h, int live) {
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int32_t stride = (int32_t)a->scale_stride_slot;
    const int32_t at = slot * stride + h * (int32_t)a->scale_stride_head - 1;
    const __m512i index =
        _mm512_add_epi32(_mm512_mullo_epi32(lanes, _mm512_set1_epi32(stride)), _mm512_set1_epi32(at));
    const __mmask16 mask = live >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << live) - 1u);
    const __m512i dwords = _mm512_mask_i32gather_epi32(
        _mm512_setzero_si512(), mask, index, scales + block * a->scale_stride_block, 2);
    return _mm512_castsi512_ps(_mm512_and_si512(dwords, _mm512_set1_epi32((int)0xffff0000u)));
}
#endif

#if defined(__AVX512BW__)
/* The same from two masked 64-byte loads and a word permute, where a block's 16 slots of
 * scales lie within 64 words (up to 4 KV heads, heads adjacent): a 16-lane gather is
 * microcoded, and perf found the byte dots waiting on it (docs/benchmarks.md, int8 KV). */
static inline __m512 permute_scales16(const uint16_t *scales, const Args *a, int64_t block,
                                      int slot, int h, int live) {
    const int stride = (int)a->scale_stride_slot;
    const uint16_t *base = scales + block * a->scale_stride_block + (int64_t)slot * stride;
    const int span = (live - 1) * stride + h + 1; /* words up to the last live scale */
    const __mmask32 lo_mask = span >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << span) - 1;
    const __mmask32 hi_mask = span <= 32   ? 0
                              : span >= 64 ? ~(__mmask32)0
                                           : ((__mmask32)1 << (span - 32)) - 1;
    const __m512i lo = _mm512_maskz_loadu_epi16(lo_mask, base);
    const __m512i hi = _mm512_maskz_loadu_epi16(hi_mask, base + 32);
    const __m256i lanes = _mm256_set_epi16(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m256i index = _mm256_add_epi16(_mm256_mullo_epi16(lanes, _mm256_set1_epi16((short)stride)),
                                           _mm256_set1_epi16((short)h));
    const __m512i words = _mm512_permutex2var_epi16(lo, _mm512_castsi256_si512(index), hi);
    const __mmask16 mask = live >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << live) - 1u);
    const __m512i dwords = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(words)), 16);
    return _mm512_castsi512_ps(_mm512_maskz_mov_epi32(mask, dwords));
}
#endif

/* An int8 cache's scales of KV head h's rows for the n keys from position `first`, as
 * fp32 (ks for K, vs for V); zeros past n. */
static inline __attribute__((always_inline)) void item_scales(const Args *a, const int32_t *table,
                                                              int32_t first, int n, int keys,
                                                              int h, float *ks, float *vs) {
    const int bs = a->block_size;
#if defined(__AVX512F__)
    if (bs >= 16 && (first & 15) == 0) { /* 16 keys at a time, each group in one block */
        for (int g = 0; g < keys; g += 16) {
            const int live = n - g;
            if (live <= 0) {
                _mm512_store_ps(ks + g, _mm512_setzero_ps());
                _mm512_store_ps(vs + g, _mm512_setzero_ps());
                continue;
            }
            const int32_t pos = first + g;
            const int64_t block = table_block(table, pos, bs);
            const int slot = pos & (bs - 1);
#if defined(__AVX512BW__)
            if (a->scale_stride_head == 1 && a->scale_stride_slot <= 4) {
                _mm512_store_ps(ks + g, permute_scales16(a->k_scale, a, block, slot, h, live));
                _mm512_store_ps(vs + g, permute_scales16(a->v_scale, a, block, slot, h, live));
                continue;
            }
#endif
            _mm512_store_ps(ks + g, gather_scales16(a->k_scale, a, block, slot, h, live));
            _mm512_store_ps(vs + g, gather_scales16(a->v_scale, a, block, slot, h, live));
        }
        return;
    }
#endif
    for (int t = 0; t < keys; t++) {
        if (t >= n) {
            ks[t] = vs[t] = 0.0f;
            continue;
        }
        const int32_t pos = first + t;
        const int64_t at = (int64_t)table_block(table, pos, bs) * a->scale_stride_block +
                           (int64_t)(pos & (bs - 1)) * a->scale_stride_slot +
                           (int64_t)h * a->scale_stride_head;
        ks[t] = bf16_to_f32(a->k_scale[at]);
        vs[t] = bf16_to_f32(a->v_scale[at]);
    }
}

/* The same for the `keys` keys from `first`, -1 from `stop` on (what a path prefetches
 * for its next step). */
static inline __attribute__((always_inline)) void item_offsets_ahead(const Args *a,
                                                                     const int32_t *table,
                                                                     int32_t first, int32_t stop,
                                                                     int keys, int h,
                                                                     int64_t *offsets) {
    const int bs = a->block_size;
    for (int t = 0; t < keys; t++) {
        const int32_t pos = first + t;
        offsets[t] = pos >= stop ? -1
                                 : (int64_t)table_block(table, pos, bs) * a->kv_stride_block +
                                       (int64_t)(pos & (bs - 1)) * a->kv_stride_slot +
                                       (int64_t)h * a->kv_stride_head;
    }
}

/* The next step's K and V cache lines of key t's row that start at element c, if one
 * starts there (rows start on 64-byte lines). The widening loops call it beside each
 * load of this step's rows, so the prefetches come spread between the loads: issued
 * as one burst per block, a block's lines ahead of a step, they made no measurable
 * difference on the Zen 4 (docs/benchmarks.md, "Prefetches spread through the loads"). */
static inline __attribute__((always_inline)) void prefetch_ahead(const Args *a,
                                                                 const int64_t *ahead, int t,
                                                                 int c) {
    const int size = kv_item_size(a->kv_dtype);
    if (ahead[t] < 0 || (((int64_t)c * size) & 63) != 0) return;
    const int64_t at = (ahead[t] + c) * size;
    prefetch_kv((const char *)a->k + at);
    prefetch_kv((const char *)a->v + at);
}

/* Write the item's rows: its partial states (m, l, acc) where it is one piece of a
 * tile, else acc / l into the output. `permuted`: acc holds the dot-pair paths' dim
 * order (attention.h), put back here. */
static inline __attribute__((always_inline)) void item_end(const Args *a, const Item *it,
                                                           const ItemState *s, float *partials,
                                                           const int D, const int permuted) {
    const int Hq = a->num_q_heads;
#if defined(__AVX512BF16__)
    float ordered[D];
#else
    (void)permuted;
#endif
    const int G = Hq / a->num_kv_heads;
    for (int r = 0; r < s->rows; r++) {
        if ((r % Hq) / G < it->head_begin || (r % Hq) / G >= it->head_end) continue;
        const float *ar = s->acc + (int64_t)r * D;
#if defined(__AVX512BF16__)
        if (permuted) {
            unpermute_row(ar, ordered, D);
            ar = ordered;
        }
#endif
        if (it->partial >= 0) {
            float *dst = partials + (it->partial + r) * (D + 2);
            dst[0] = s->m[r];
            dst[1] = s->l[r];
            memcpy(dst + 2, ar, sizeof(float) * D);
            continue;
        }
        const int i = it->q_begin + r / Hq, head = r % Hq;
        const float inv = 1.0f / s->l[r]; /* l >= 1: a row always sees its own key */
        const int64_t offset =
            (int64_t)(s->start + i) * a->out_stride_t + (int64_t)head * a->out_stride_h;
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

/* A path's loop over one step's `n` keys from position `first`, for KV head h: the
 * rows of those keys at `offsets` (elements), the next step's at `ahead` (-1 past the
 * item's keys). `ctx` is the path's own. */
typedef void (*KeyStepFn)(const Args *a, const Item *it, const ItemState *s,
                          const int64_t *offsets, const int64_t *ahead, int32_t first, int n,
                          int h, void *ctx, const int D);

/* Once per item, after `item_begin` and before the keys. */
typedef void (*ItemPrepareFn)(const Args *a, const Item *it, const ItemState *s, void *ctx,
                              const int D);

typedef struct {
    /* 1: a pair path (dot pairs, tile unit): the query rows kept as bf16, acc in the pair
     * order (attention.h), 32 keys per step and the next step's rows prefetched per head.
     * 0: the widening loops: fp32 query rows times the scale, 16 keys per step and the
     * next step's rows prefetched beside this step's loads. */
    int pairs;
    ItemPrepareFn prepare; /* NULL: nothing to do */
    KeyStepFn step;
} KeyPath;

static inline __attribute__((always_inline)) void walk(const Args *a, const Item *it,
                                                       float *scratch, float *partials,
                                                       const KeyPath *path, void *ctx,
                                                       const int D) {
    ItemState s = item_begin(a, it, scratch, D, path->pairs);
    if (path->prepare) path->prepare(a, it, &s, ctx, D);
    const int keys = path->pairs ? 2 * TILE : TILE;
    /* The step's rows of KV head 0 (and the next step's), once; head h's lie h heads on. */
    int64_t rows0[2 * TILE], ahead0[2 * TILE], offsets[2 * TILE], ahead[2 * TILE];
    const int quantized = a->kv_dtype == DTYPE_INT8;
    for (int32_t first = it->key_begin; first < s.stop; first += keys) {
        const int n = s.stop - first < keys ? s.stop - first : keys;
        if (quantized) prefetch_scales(a, s.table, first + keys, s.stop, keys);
        item_offsets(a, s.table, first, n, 0, rows0);
        item_offsets_ahead(a, s.table, first + keys, s.stop, keys, 0, ahead0);
        for (int h = it->head_begin; h < it->head_end; h++) {
            const int64_t head = (int64_t)h * a->kv_stride_head;
            for (int t = 0; t < n; t++) offsets[t] = rows0[t] + head;
            for (int t = 0; t < keys; t++) ahead[t] = ahead0[t] < 0 ? -1 : ahead0[t] + head;
            if (quantized) item_scales(a, s.table, first, n, keys, h, s.ks, s.vs);
            path->step(a, it, &s, offsets, ahead, first, n, h, ctx, D);
        }
    }
    item_end(a, it, &s, partials, D, path->pairs);
}

/* One item on `path`, for any head size: 64 and 128 get their own fully unrolled copies. */
static inline __attribute__((always_inline)) void walk_head_dims(const Args *a, const Item *it,
                                                                 float *scratch, float *partials,
                                                                 const KeyPath *path, void *ctx,
                                                                 int head_dim) {
    switch (head_dim) {
        case 64: walk(a, it, scratch, partials, path, ctx, 64); break;
        case 128: walk(a, it, scratch, partials, path, ctx, 128); break;
        default: walk(a, it, scratch, partials, path, ctx, head_dim); break;
    }
}

#endif
