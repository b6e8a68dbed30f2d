/* The shared-prefix planner of the native CPU attention.
 *
 * Sequences whose block tables start with the same blocks (one system prompt, the
 * forks of n > 1) read the same keys there. Up to a tile's worth of their new tokens
 * (16 rows per KV head) then attend to those keys together, as one item on the tile
 * unit, and each sequence attends to the rest of its context on its own; the two
 * partial states are merged like slices (attention_merge.c):
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

#include "attention.h"

#if defined(CHATSVC_AMX)

/* Fewest shared keys a group attends to together. */
enum { MIN_SHARED_KEYS = 64 };

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

/* Groups with at least two members are kept (the rest are dissolved). Sequences
 * that start with the same block are spread evenly over as few items as hold
 * their tokens (16 decodes of 3 rows: 4 items of 4, not 5 + 5 + 5 + 1 left alone). */
int32_t plan_shared(const int32_t *block_tables, int64_t table_stride,
                    const int32_t *query_start, const int32_t *context_lens, const int32_t *seqs,
                    int32_t num_seqs, int32_t block_size, int32_t cap, SharedGroup *groups,
                    int32_t *group, int32_t *scratch) {
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
