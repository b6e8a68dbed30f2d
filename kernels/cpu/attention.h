/* What the files of the native CPU attention share (kernels/cpu/attention*.c).
 *
 *   attention.c           the entry: work items, slices, the thread team, the path per item
 *   attention_plan.c      the shared-prefix planner (`plan_shared`)
 *   attention_merge.c     the merge of an item's partial states (`merge_tile`)
 *   attention_portable.c  the widening loops in portable C (builds without AVX-512 or AVX2)
 *   attention_avx2.c      the widening loops on AVX2 + FMA (K and V widened to fp32)
 *   attention_avx512.c    the widening loops on AVX-512 (K and V widened to fp32)
 *
 * int8 caches take the widening loops (K and V rows widened from int8, each key's scale
 * applied to its score and each value's folded into its weight, p_t * s_t; the softmax
 * sum l keeps the unscaled p), or with bf16 queries on AVX512-VNNI the byte dots:
 *   attention_int8.c      integer dot products on int8 caches (`attend_byte_dots`)
 *   attention_bf16.c      bf16 dot pairs on AVX512-BF16 (`attend_dot_pairs`)
 *   attention_amx.c       runs of new tokens on the tile unit (`attend_tiles`)
 *   attention_walk.h      the walk of a work item over its keys, written once for the paths
 *
 * A work item walks one sequence's keys for a tile of its new tokens; each path file
 * holds its per-key-tile loop and hands it to the walk (attention_walk.h). The pieces
 * the AVX-512 paths share (the 16x16 transpose, the vector exp2, the bf16 pair loads
 * and the 32-key softmax step) sit here, behind the instruction set that defines them.
 *
 * Everything here trusts its arguments: the Python wrapper (kernels/cpu/attention.py)
 * checked them.
 */

#ifndef CHATSVC_CPU_ATTENTION_H
#define CHATSVC_CPU_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "common.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Functions one file of the library calls in another: not exported by the library. */
#define CHATSVC_INTERNAL __attribute__((visibility("hidden")))

typedef struct {
    const void *q;
    int64_t q_stride_t, q_stride_h;
    const void *k, *v;
    int64_t kv_stride_block, kv_stride_slot, kv_stride_head;
    /* int8 caches (kv_dtype DTYPE_INT8, kernels/kv_layout.py): each (token, head) row's
     * scale, bf16; NULL for float caches. */
    const uint16_t *k_scale, *v_scale;
    int64_t scale_stride_block, scale_stride_slot, scale_stride_head;
    void *out;
    int64_t out_stride_t, out_stride_h;
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *query_start, *context_lens;
    int32_t num_q_heads, num_kv_heads, block_size, q_tile;
    int32_t dtype;    /* the query's and the output's */
    int32_t kv_dtype; /* the caches': dtype, or DTYPE_INT8 */
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
    /* KV heads [head_begin, head_end) only: a lone whole item is cut by KV head so that
     * every thread gets a part (a head's rows are computed alike either way). */
    int32_t head_begin, head_end;
} Item;

/* A tile of one sequence's new tokens, its own items (first_item, num_items: the
 * pieces of its keys, shared items aside) and where its pieces' partial states lie:
 * row r of piece p at partials[(parts[first_part + p] + r) * (D + 2)]. */
typedef struct {
    int32_t seq, q_begin, q_end;
    int32_t first_part, num_parts;
    int64_t first_item, num_items;
} Tile;

/* Sequences attending to their common leading blocks together (`plan_shared`). */
typedef struct {
    int32_t leader;        /* batch index whose table the item reads */
    int32_t shared_blocks; /* S / block_size */
    int32_t num_members;
    int32_t num_tokens;    /* members' new tokens */
    int32_t target;        /* tokens it takes: its class's tokens spread evenly, <= cap */
} SharedGroup;

/* Key tiles are 16 tokens: one fp32 vector of scores per query row. */
enum { TILE = 16 };

/* The tile unit's rows per KV head, and the fewest an item needs to take it (a lone
 * decode's G rows would waste the rest of the tile). */
enum { AMX_ROWS = 16, AMX_MIN_ROWS = 6 };

/* Row `offset` (elements) of a cache or query tensor as fp32: in place for fp32,
 * widened into `scratch` for bf16 and int8 (an int8 row without its scale). */
static inline const float *row_f32(const void *base, int64_t offset, int n, int dtype,
                                   float *scratch) {
    if (dtype == DTYPE_F32) return (const float *)base + offset;
    if (dtype == DTYPE_INT8) {
        const int8_t *src = (const int8_t *)base + offset;
#pragma omp simd
        for (int i = 0; i < n; i++) scratch[i] = (float)src[i];
        return scratch;
    }
    const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
    for (int i = 0; i < n; i++) scratch[i] = bf16_to_f32(src[i]);
    return scratch;
}

/* The software prefetch of keys and values a step or a block ahead: into L2, not L1.
 * A step's prefetches come in a burst (a line per key and head); aimed at L1 they fill
 * its few miss buffers and stall the loads the step needs now (docs/kernels.md). */
static inline __attribute__((always_inline)) void prefetch_kv(const void *p) {
    __builtin_prefetch(p, 0, 1);
}

/* The block table entry of key position `pos` >= 0: block sizes are powers of two, and
 * a shift spares the walk an integer division per key (a division by a runtime size). */
static inline int32_t table_block(const int32_t *table, int32_t pos, int block_size) {
    return table[pos >> __builtin_ctz((unsigned)block_size)];
}

/* Bytes of one element of a cache of `kv_dtype`. */
static inline int kv_item_size(int kv_dtype) {
    return kv_dtype == DTYPE_F32 ? 4 : kv_dtype == DTYPE_INT8 ? 1 : 2;
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

/* Scratch of one thread, in floats, for items of up to `rows` rows: see `ItemState`. */
static inline int64_t scratch_floats(int64_t rows, int64_t head_dim) {
    return 2 * rows * head_dim + 2 * rows + 2 * TILE * head_dim + 4 * TILE;
}

#if defined(__AVX512F__)
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

/* 2^x for x <= 0, the Taylor series of 2^f (|f| <= 1/2) to degree `degree` (7: within
 * fp32 rounding; 4: within 4.2e-5 relative, for weights that are then rounded to 8 bits). */
static inline __attribute__((always_inline)) __m512 exp2_nonpositive16_degree(__m512 x,
                                                                                const int degree) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(EXP2_TAYLOR[7 - degree]);
    for (int c = 8 - degree; c < 8; c++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_TAYLOR[c]));
    return _mm512_scalef_ps(p, n);
}

static inline __attribute__((always_inline)) __m512 exp2_nonpositive16(__m512 x) {
    return exp2_nonpositive16_degree(x, 7);
}
#endif

#if defined(__AVX512BF16__)
/* bf16 caches on CPUs with AVX512-BF16 (the dot-pair and tile paths): vdpbf16ps
 * multiplies pairs of bf16 and adds both products to one fp32 lane, so K and V are
 * used as stored (no widening) and a key tile needs half the shuffles of the fp32
 * path:
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
 * of dims {0-3, 8-11, 16-19, 24-27} and {4-7, 12-15, 20-23, 28-31} (the pair
 * order); rows are put back in order when they leave the item (`unpermute_row`). */

static inline __m512i load_bf16x32(const void *base, int64_t offset) {
    return _mm512_loadu_si512((const uint16_t *)base + offset);
}

/* The two-source permute that takes 128-bit lanes 0-1 (`high` 0) or 2-3 (`high` 1) of
 * A and B in turn: A's lane, B's lane, A's next, B's next. Dims 0-15 of a 32-dim group
 * in the pair order are lanes 0-1 of its A and B vectors, dims 16-31 lanes 2-3. */
static inline __m512i pair_lanes_index(int high) {
    return high ? _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8)
                : _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
}

static inline void unpermute_row(const float *acc, float *row, const int D) {
    const __m512i low = pair_lanes_index(0), high = pair_lanes_index(1);
    for (int g = 0; g < D; g += 32) {
        const __m512 a = _mm512_loadu_ps(acc + g), b = _mm512_loadu_ps(acc + g + 16);
        _mm512_storeu_ps(row + g, _mm512_permutex2var_ps(a, low, b));
        _mm512_storeu_ps(row + g + 16, _mm512_permutex2var_ps(a, high, b));
    }
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
                    const int64_t at = (next[t] + c) * 2;
                    prefetch_kv((const char *)a->k + at);
                    prefetch_kv((const char *)a->v + at);
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

/* The weights of up to 32 keys (raw dot products of keys 0-15 and 16-31; the first `seen`
 * count) against the row's running max `m`: p0, p1 (zeros past `seen`), and the new max,
 * returned; exp2 to `degree` (`exp2_nonpositive16_degree`). What each pair path's softmax
 * step shares. */
static inline __attribute__((always_inline)) float softmax_weights32(__m512 raw0, __m512 raw1,
                                                                     int seen, float scale_log2,
                                                                     float m, __m512 *p0,
                                                                     __m512 *p1, const int degree) {
    const uint32_t live = seen >= 32 ? 0xffffffffu : (1u << seen) - 1u;
    const __mmask16 live0 = (__mmask16)live, live1 = (__mmask16)(live >> 16);
    const __m512 scale = _mm512_set1_ps(scale_log2), minus_inf = _mm512_set1_ps(-INFINITY);
    const __m512 s0 = _mm512_mask_mov_ps(minus_inf, live0, _mm512_mul_ps(raw0, scale));
    const __m512 s1 = _mm512_mask_mov_ps(minus_inf, live1, _mm512_mul_ps(raw1, scale));
    const float step_top = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
    const float top = step_top > m ? step_top : m;
    const __m512 t = _mm512_set1_ps(top);
    *p0 = _mm512_maskz_mov_ps(live0, exp2_nonpositive16_degree(_mm512_sub_ps(s0, t), degree));
    *p1 = _mm512_maskz_mov_ps(live1, exp2_nonpositive16_degree(_mm512_sub_ps(s1, t), degree));
    return top;
}

/* Online-softmax update of one row with the scores of up to 32 keys: returns the weights
 * as 32 bf16 (key order), updates m and l with their rounded sum, and sets alpha. */
static inline __attribute__((always_inline)) __m512i softmax_step32(__m512 raw0, __m512 raw1,
                                                                    int seen, float scale_log2,
                                                                    float *m, float *l,
                                                                    float *alpha) {
    __m512 p0, p1;
    const float top = softmax_weights32(raw0, raw1, seen, scale_log2, *m, &p0, &p1, 7);
    const __m512i p = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
    /* The weights P.V will use, widened back for their sum. */
    const __m512 lo = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(p)), 16));
    const __m512 hi = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(p, 1)), 16));
    update_row(top, m, l, _mm512_reduce_add_ps(_mm512_add_ps(lo, hi)), alpha);
    return p;
}
#endif

#if defined(CHATSVC_AMX)
/* Floats of a thread's tile scratch: per KV head its rows packed [16][D] (bf16),
 * scores [16][32], weights [16][32] (bf16), P.V [16][D], alpha [16]. */
static inline int64_t amx_scratch_floats(int64_t num_kv_heads, int64_t head_dim) {
    return num_kv_heads * AMX_ROWS * head_dim / 2 + AMX_ROWS * 32 + AMX_ROWS * 16 +
           AMX_ROWS * head_dim + AMX_ROWS;
}
#endif

/* The paths: one work item each, for any head size (64 and 128 get their own fully
 * unrolled copies). Exactly one widening path exists in a build: AVX-512 where the
 * target has it, else portable C. */
CHATSVC_INTERNAL void attend_widening(const Args *a, const Item *it, float *scratch,
                                      float *partials, int head_dim);
#if defined(__AVX512BF16__)
CHATSVC_INTERNAL void attend_dot_pairs(const Args *a, const Item *it, float *scratch,
                                       float *partials, int head_dim);
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
/* bf16 queries over int8 caches. */
CHATSVC_INTERNAL void attend_byte_dots(const Args *a, const Item *it, float *scratch,
                                       float *partials, int head_dim);
#endif
#if defined(CHATSVC_AMX)
/* `amx`: the thread's tile scratch (`amx_scratch_floats`), its tiles configured. */
CHATSVC_INTERNAL void attend_tiles(const Args *a, const Item *it, float *scratch,
                                   float *partials, float *amx, int head_dim);
#endif

/* Merge the pieces of one tile into the output. */
CHATSVC_INTERNAL void merge_tile(const Args *a, const Tile *tile, const int64_t *parts,
                                 const float *partials, int head_dim);

#if defined(CHATSVC_AMX)
/* Assign sequences to shared groups: group[s] for seqs[s], -1 for none; returns the
 * number of groups (each of two or more members). `scratch`: num_seqs ints. */
CHATSVC_INTERNAL int32_t plan_shared(const int32_t *block_tables, int64_t table_stride,
                                     const int32_t *query_start, const int32_t *context_lens,
                                     const int32_t *seqs, int32_t num_seqs, int32_t block_size,
                                     int32_t cap, SharedGroup *groups, int32_t *group,
                                     int32_t *scratch);
#endif

#endif
