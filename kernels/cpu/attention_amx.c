/* Runs of several new tokens on CPUs with AMX. One tile instruction multiplies
 * 16 x 32 bf16 by 32 x 16 bf16 into 16 x 16 fp32, so the rows of one KV head (its
 * query heads x the item's new tokens, up to 16) get their scores and P.V from the
 * tile unit and only the softmax runs in vector code. K and V come in the dot-pair
 * path's layouts (attention.h), which are the tile unit's B operands as they are
 * (kt: dword columns for Q.K^T; vv: key pairs for P.V), so acc keeps that path's dim
 * order. A decode alone has G rows per head (3 for SmolLM2): it stays on the vector
 * paths, which waste no tile rows, except for the keys it shares (`plan_shared`).
 * The caller configured this thread's tiles (amx.h). */

#include "attention_walk.h"

#if defined(CHATSVC_AMX)

/* The tile path's part of a thread's tile scratch for one item (`pack_rows`). */
typedef struct {
    float *amx;      /* the whole of it (`amx_scratch_floats`) */
    uint16_t *qh;    /* per KV head its rows packed [AMX_ROWS][D] (bf16) */
    float *tiles;    /* scores, weights, P.V and alpha of one step */
    int nrows;       /* rows per KV head: the item's tokens x G */
} TileRows;

/* One step of up to 32 keys of one KV head against its `nrows` packed rows `qh`
 * (row j = token q_begin + j / G, query head h * G + j % G). */
static inline __attribute__((always_inline)) void tile_head_amx(
    const Args *a, const Item *it, const ItemState *s, const int64_t *offsets,
    const int64_t *ahead, int32_t first, int n, int h, void *ctx, const int D) {
    const TileRows *rows = ctx;
    const uint16_t *qh = rows->qh + (int64_t)h * AMX_ROWS * D;
    const int nrows = rows->nrows;
    float *acc = s->acc, *m = s->m, *l = s->l, *kt = s->kt, *vv = s->v_tile;
    float *tiles = rows->tiles;
    const int32_t prefix = s->prefix;
    const int q_begin = it->q_begin;
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

/* Before an item's keys: its rows packed per KV head into the tile scratch. */
static inline __attribute__((always_inline)) void pack_rows(const Args *a, const Item *it,
                                                            const ItemState *s, void *ctx,
                                                            const int D) {
    TileRows *rows = ctx;
    const int Hq = a->num_q_heads, G = Hq / a->num_kv_heads;
    rows->nrows = (it->q_end - it->q_begin) * G;
    rows->qh = (uint16_t *)rows->amx;
    rows->tiles = rows->amx + (int64_t)a->num_kv_heads * AMX_ROWS * D / 2;
    /* Zeros: the unused tile rows, and V pairs no step has loaded yet (weight 0 times
     * whatever is there must stay 0). */
    memset(rows->amx, 0, sizeof(float) * amx_scratch_floats(a->num_kv_heads, D));
    memset(s->v_tile, 0, sizeof(float) * TILE * D);
    for (int h = 0; h < a->num_kv_heads; h++)
        for (int j = 0; j < rows->nrows; j++)
            memcpy(rows->qh + ((int64_t)h * AMX_ROWS + j) * D,
                   (const uint16_t *)s->q + (int64_t)((j / G) * Hq + h * G + j % G) * D, 2 * D);
}

static const KeyPath TILES = {.pairs = 1, .prepare = pack_rows, .step = tile_head_amx};

void attend_tiles(const Args *a, const Item *it, float *scratch, float *partials, float *amx,
                  int head_dim) {
    TileRows rows = {.amx = amx};
    walk_head_dims(a, it, scratch, partials, &TILES, &rows, head_dim);
}

#endif
