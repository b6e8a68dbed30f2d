/* Paged attention on the CPU, reading K/V blocks where they lie in the pool: the
 * entry point (`chatsvc_paged_attention`), which cuts a call into work items, runs them
 * on the thread team and merges the pieces.
 *
 * The torch path gathers each sequence's blocks into a padded copy per layer
 * and then runs SDPA over the copy; for decodes and short new turns the copy
 * costs as much as the attention. This kernel walks the block table instead:
 *
 *   work item = (sequence, tile of up to q_tile new tokens, span or slice of its keys)
 *   rows      = the tile's tokens x all query heads
 *   for each 16-token key tile of the slice, up to the tile's last position, and
 *   each KV head:
 *       scores = rows of the head's GROUP . K[keys, head]^T   (read in place, bf16 or
 *                                                              int8 -> fp32; an int8
 *                                                              key's scale times its score)
 *       online softmax per row (exp2, scale folded into Q), causal per row
 *       acc    = acc * alpha + P . V[keys, head]
 *   out = acc / l   (or, for a tile whose keys are cut in pieces, partial (m, l, acc)
 *                    merged afterwards: flash-decoding, so one long sequence
 *                    still keeps every thread busy)
 *
 * How keys are cut decides whether a token's output depends on its step:
 *
 *   span > 0   (invariant, the default) every query's keys are cut at the same absolute
 *              positions, multiples of `span` (kernels/invariance.py), whatever the
 *              batch, the tile or the chunk; a row's pieces are merged in key order. A
 *              row's arithmetic depends only on its own query and keys, so its output
 *              is bit-identical in a decode, a prefill chunk of any length, alone or
 *              batched. Every row of a dtype takes one path (no tile unit, no shared
 *              items: those order a row's sums by what else is in the call).
 *   span == 0  slices sized to keep the threads busy, shared-prefix items and the tile
 *              unit where they pay: faster for some steps, the last bits depend on them.
 *
 * An item takes all KV heads of a block because a block's K (and V) rows hold
 * every head side by side: one item then reads each cache line once.
 *
 * Sequences whose tables start with the same blocks (a shared system prompt) attend
 * to those blocks together in one item on the tile unit, where it has one, and to
 * the rest on their own (attention_plan.c).
 *
 * Each item takes one of the paths (`attend_item`), one file each:
 *
 *   widening loops   any dtype: K/V widened to fp32      attention_avx512.c
 *                                                        (attention_avx2.c on AVX2,
 *                                                        attention_portable.c
 *                                                        elsewhere)
 *   dot pairs        bf16 on AVX512-BF16                 attention_bf16.c
 *   byte dots        int8 caches, bf16 queries, VNNI     attention_int8.c
 *   tile unit        bf16 runs of several tokens, AMX    attention_amx.c
 *
 * Items run in parallel on the caller's OpenMP team (torch's own libgomp,
 * already loaded in the process, so no second team competes for the cores).
 * Sums are fp32; bf16 is widened by a shift and narrowed round-to-nearest-even,
 * as torch does. Inputs are checked by the Python wrapper (kernels/cpu/attention.py):
 * these files trust their arguments.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "exports.h"

/* Blocks per slice at least, when a sequence is split (below that, the merge
 * costs more than the idle thread would). */
enum { MIN_SLICE_BLOCKS = 16 };

/* The path of one item. Bf16 items (bf16 caches) with a head size the dot pairs take go
 * to the tile unit where the thread set it up (`amx`) and each KV head has enough rows
 * to fill a tile, else to the dot pairs; bf16 queries over int8 caches to the byte dots
 * where the CPU has AVX512-VNNI; the rest to the widening loops. */
static void attend_item(const Args *a, const Item *it, float *scratch, float *partials,
                        float *amx, int head_dim) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    if (a->dtype == DTYPE_BF16 && a->kv_dtype == DTYPE_INT8 && head_dim % 32 == 0) {
        attend_byte_dots(a, it, scratch, partials, head_dim);
        return;
    }
#endif
#if defined(__AVX512BF16__)
    if (a->dtype == DTYPE_BF16 && a->kv_dtype == DTYPE_BF16 && head_dim % 32 == 0) {
#if defined(CHATSVC_AMX)
        const int nrows = (it->q_end - it->q_begin) * (a->num_q_heads / a->num_kv_heads);
        if (amx && nrows >= AMX_MIN_ROWS && nrows <= AMX_ROWS) {
            attend_tiles(a, it, scratch, partials, amx, head_dim);
            return;
        }
#endif
        attend_dot_pairs(a, it, scratch, partials, head_dim);
        return;
    }
#endif
    (void)amx;
    attend_widening(a, it, scratch, partials, head_dim);
}

/* Keys times tokens of an item: the keys its last token reads (causal; a shared-prefix
 * item's tokens all read every shared key). */
static int64_t item_work(const Args *a, const Item *it) {
    if (it->tokens) return (int64_t)(it->key_end - it->key_begin) * (it->q_end - it->q_begin);
    const int32_t b = it->seq;
    const int32_t prefix = a->context_lens[b] - (a->query_start[b + 1] - a->query_start[b]);
    const int32_t stop = prefix + it->q_end < it->key_end ? prefix + it->q_end : it->key_end;
    return (int64_t)(stop > it->key_begin ? stop - it->key_begin : 0) * (it->q_end - it->q_begin);
}

/* Where a few items cannot keep every thread busy, each becomes one item per KV head,
 * appended (tiles keep their item indices): fewer items than threads (a lone decode of
 * up to a span's keys), or one item holding more than a thread's share of the work (a
 * lone decode just past a span: 256 keys and 1, which one thread would walk alone).
 * A head's rows are computed alike either way, and a cut piece writes its heads' rows
 * of the partials the merge reads. Shared-prefix items stay whole. Only where no
 * thread takes whole tiles (`by_tile`: those run a tile's own items) and there are at
 * most 2 x num_threads items (the room left for the cut). Returns the item count. */
static int64_t cut_by_heads(const Args *a, Item *items, int64_t n, int32_t num_threads,
                            int by_tile) {
    const int32_t num_kv_heads = a->num_kv_heads;
    if (num_kv_heads < 2 || by_tile || n > 2 * (int64_t)num_threads) return n;
    int64_t total = 0, most = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t work = item_work(a, &items[i]);
        total += work;
        most = work > most ? work : most;
    }
    if (n >= num_threads && most * num_threads <= total) return n;
    const int64_t whole = n;
    for (int64_t i = 0; i < whole; i++) {
        if (items[i].tokens) continue;
        for (int32_t h = 1; h < num_kv_heads; h++) {
            items[n] = items[i];
            items[n].head_begin = h;
            items[n++].head_end = h + 1;
        }
        items[i].head_end = 1;
    }
    return n;
}

/* Attention of the new tokens of sequences `seqs[0..num_seqs)` (indices into the
 * batch); rows of other sequences in `out` are left untouched. Strides are in
 * elements; K and V share theirs, and so do their scales (an int8 cache: `kv_dtype`
 * DTYPE_INT8; NULL otherwise). Returns 0, or -1 when scratch memory runs out (nothing
 * is then written). */
int chatsvc_paged_attention(const void *q, int64_t q_stride_t, int64_t q_stride_h,
                            const void *k, const void *v, int64_t kv_stride_block,
                            int64_t kv_stride_slot, int64_t kv_stride_head,
                            const uint16_t *k_scale, const uint16_t *v_scale,
                            int64_t scale_stride_block, int64_t scale_stride_slot,
                            int64_t scale_stride_head, void *out, int64_t out_stride_t,
                            int64_t out_stride_h, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *query_start,
                            const int32_t *context_lens, const int32_t *seqs, int32_t num_seqs,
                            int32_t num_q_heads, int32_t num_kv_heads, int32_t head_dim,
                            int32_t block_size, int32_t q_tile, int32_t span, float scale_log2,
                            int32_t dtype, int32_t kv_dtype, int32_t num_threads) {
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
    if (span == 0 && dtype == DTYPE_BF16 && kv_dtype == DTYPE_BF16 && head_dim % 32 == 0 &&
        AMX_ROWS / G >= 1 && amx_usable()) {
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
    const Args a = {.q = q,
                    .q_stride_t = q_stride_t,
                    .q_stride_h = q_stride_h,
                    .k = k,
                    .v = v,
                    .kv_stride_block = kv_stride_block,
                    .kv_stride_slot = kv_stride_slot,
                    .kv_stride_head = kv_stride_head,
                    .k_scale = k_scale,
                    .v_scale = v_scale,
                    .scale_stride_block = scale_stride_block,
                    .scale_stride_slot = scale_stride_slot,
                    .scale_stride_head = scale_stride_head,
                    .out = out,
                    .out_stride_t = out_stride_t,
                    .out_stride_h = out_stride_h,
                    .block_tables = block_tables,
                    .table_stride = table_stride,
                    .query_start = query_start,
                    .context_lens = context_lens,
                    .num_q_heads = num_q_heads,
                    .num_kv_heads = num_kv_heads,
                    .block_size = block_size,
                    .q_tile = q_tile,
                    .dtype = dtype,
                    .kv_dtype = kv_dtype,
                    .scale_log2 = scale_log2};
    int64_t num_tiles = 0, num_tokens = 0, num_spans = 0;
    for (int32_t s = 0; s < num_seqs; s++) {
        const int32_t b = seqs[s];
        const int32_t q_len = query_start[b + 1] - query_start[b];
        const int32_t prefix = context_lens[b] - q_len;
        num_tiles += (q_len + q_tile - 1) / q_tile;
        num_tokens += q_len;
        for (int32_t begin = 0; span > 0 && begin < q_len; begin += q_tile) {
            const int32_t end = begin + q_tile < q_len ? begin + q_tile : q_len;
            num_spans += (prefix + end - 1) / span + 1;
        }
    }
    if (num_tiles == 0) {
        free(groups);
        free(group);
        return 0;
    }
    /* Without spans, split tiles into slices only when there are too few tiles to share
     * out. Each tile becomes at most `want` items (its spans with them), plus a piece
     * of its group's shared item. */
    const int64_t want = span > 0 || num_tiles >= 2 * num_threads
                             ? 1
                             : (4 * num_threads + num_tiles - 1) / num_tiles;
    const int64_t max_items = span > 0 ? num_spans : num_tiles * want;
    /* Room for `cut_by_heads`: up to 2 x num_threads items, each cut into one per KV head. */
    Item *items = malloc(sizeof(Item) *
                         (max_items + num_groups + 1 + 2 * (int64_t)num_threads * num_kv_heads));
    Tile *tiles = malloc(sizeof(Tile) * (num_tiles + 1));
    int64_t *parts = malloc(sizeof(int64_t) * (max_items + num_tiles + 1));
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
                   partial_rows, shared_tokens + filled, 0, num_kv_heads};
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
        int32_t per_slice = (int32_t)((blocks + slices - 1) / slices) * block_size;
        const int32_t prefix = context_lens[b] - q_len;
        for (int32_t begin = 0; begin < q_len; begin += q_tile) {
            const int32_t end = begin + q_tile < q_len ? begin + q_tile : q_len;
            if (span > 0) { /* the spans the tile's last row reaches, from key 0 */
                slices = (prefix + end - 1) / span + 1;
                per_slice = span;
            }
            const int split = slices > 1 || g >= 0;
            Tile *t = &tiles[tile++];
            *t = (Tile){b, begin, end, (int32_t)num_parts, 0, n, 0};
            if (g >= 0) /* a member has all its tokens in one tile (q_len <= cap) */
                parts[num_parts++] = shared_offset[g] + (int64_t)(member_token[g] + begin) * num_q_heads;
            for (int64_t p = 0; p < slices; p++) {
                Item it = {b, begin, end, key_begin + (int32_t)p * per_slice,
                           key_begin + (int32_t)(p + 1) * per_slice, -1, NULL, 0, num_kv_heads};
                if (split) {
                    it.partial = partial_rows;
                    parts[num_parts++] = partial_rows;
                    partial_rows += (int64_t)(end - begin) * num_q_heads;
                }
                items[n++] = it;
            }
            t->num_parts = (int32_t)num_parts - t->first_part;
            t->num_items = n - t->first_item;
        }
        if (g >= 0) member_token[g] += q_len;
    }

    float *partials = partial_rows ? malloc(sizeof(float) * partial_rows * (head_dim + 2)) : NULL;
    const int64_t rows = (int64_t)q_tile * num_q_heads;
    const int64_t scratch_bytes =
        ((scratch_floats(rows, head_dim) * (int64_t)sizeof(float) + 63) / 64) * 64;
    int failed = partial_rows && !partials;
    /* With tiles enough to keep every thread busy (and no shared items, whose pieces
     * other tiles read), a thread takes a whole tile: its pieces, then their merge, with
     * no barrier between. Otherwise each piece is a task of its own (one long sequence
     * still keeps every thread busy) and the merges follow them all. A row's pieces and
     * its merge are the same either way. */
    const int by_tile = num_groups == 0 && num_tiles >= 2 * (int64_t)num_threads;
    const int64_t num_items = cut_by_heads(&a, items, n, num_threads, by_tile);
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
        if (!failed && by_tile) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < num_tiles; t++) {
                const Tile *own = &tiles[t];
                for (int64_t i = own->first_item; i < own->first_item + own->num_items; i++)
                    attend_item(&a, &items[i], scratch, partials, amx, head_dim);
                if (own->num_parts > 1) merge_tile(&a, own, parts, partials, head_dim);
            }
        } else if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < num_items; i++)
                attend_item(&a, &items[i], scratch, partials, amx, head_dim);
            if (partial_rows) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t t = 0; t < num_tiles; t++)
                    if (tiles[t].num_parts > 1)
                        merge_tile(&a, &tiles[t], parts, partials, head_dim);
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
 * in the first case (kernels/cpu/attention.py: native_max_query). */
int chatsvc_attention_uses_tiles(void) { return amx_usable(); }
