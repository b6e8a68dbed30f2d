/* A step's decoder layers in one call (`chatsvc_decoder_layers`), for a model whose
 * matrices are all in one of the native linears' layouts: an fp32 model over narrow
 * blocks (narrow_linear.c), a bf16 model over dot pairs (pair_linear.c) or tiles
 * (tile_linear.c), on the native step.
 *
 * The same kernels, in the same order, with the same arguments as the model's own
 * loop over its layers (chatsvc/engine/llama.py), so every value comes out the same
 * bits. What goes is that loop's cost: ten calls a layer through ctypes, each with its
 * checks and a new output tensor, which for one decode token took longer than the
 * kernels they ran (docs/benchmarks.md, "The layers in one call").
 *
 * Per layer, rows of the step's T tokens in the step's dtype:
 *
 *   x = rms_norm(h)                  qkv = x . Wqkv^T (+ b)      rope(q, k) in place
 *   write_kv(k, v)                   o = attention(q)            h2 = h + o . Wo^T
 *   x = rms_norm(h2)                 gu = x . Wgu^T              act = swiglu(gu)
 *   h = h2 + act . Wd^T
 *
 * h and h2 take turns, so each layer's output is back in h. */

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "exports.h"

/* Which linear a matrix is packed for (kernels/cpu/decoder.py: LINEAR_KINDS). */
enum { LINEAR_NARROW = 0, LINEAR_PAIRS = 1, LINEAR_TILES = 2 };

/* One packed matrix: its linear's weight arguments. */
typedef struct {
    const void *packed;
    const float *scale; /* narrow int8 blocks: [n], else NULL */
    const void *bias;   /* [n] in the step's dtype, or NULL */
    int64_t n, k;
    int32_t kind;   /* LINEAR_* */
    int32_t format; /* narrow blocks: narrow_linear.c's FORMAT_* */
} DecoderMatrix;

typedef struct {
    const void *input_norm, *post_norm; /* [hidden] in the step's dtype */
    DecoderMatrix qkv, o, gate_up, down;
} DecoderLayer;

/* Everything one step reads and writes. kernels/cpu/decoder.py mirrors it field for
 * field (checked by size, `chatsvc_decoder_sizes`). */
typedef struct {
    /* The model. */
    const DecoderLayer *layers;
    int64_t num_layers, hidden, num_q_heads, num_kv_heads, head_dim, intermediate;
    float eps, scale_log2;
    int32_t dtype; /* of the rows, norms and biases: DTYPE_F32 (narrow) or DTYPE_BF16 */
    /* The KV pool: layer 0's K rows; its V `v_bytes` on; each layer `layer_bytes` on.
     * Strides in elements, shared by K and V. */
    char *kv;
    int64_t layer_bytes, v_bytes, kv_stride_block, kv_stride_slot, kv_stride_head, block_size;
    int32_t kv_dtype;
    /* An int8 pool's scales (else NULL): layer 0's K scales, laid out as the rows. */
    char *scales;
    int64_t scale_layer_bytes, v_scale_bytes, scale_stride_block, scale_stride_slot,
        scale_stride_head;
    /* The step: cos and sin [T, head_dim], slots [T], the attention's index arrays. */
    int64_t tokens;
    const void *cos, *sin;
    const int64_t *slots;
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *query_start, *context_lens, *seqs;
    int32_t num_seqs, q_tile, span, num_threads;
    /* Rows of the step in its dtype: h holds the embeddings in and the last layer's
     * output out; the rest is scratch ([T, hidden] h2 and x, [T, q + 2 kv] qkv, [T, q]
     * o, [T, 2 I] gate_up, [T, I] act). */
    void *h, *h2, *x, *qkv, *o, *gate_up, *act;
} DecoderStep;

static inline int64_t item_size(const DecoderStep *s) { return s->dtype == DTYPE_F32 ? 4 : 2; }

/* Element `i` of a row array of the step's dtype. */
static inline char *at(const DecoderStep *s, void *rows, int64_t i) {
    return (char *)rows + i * item_size(s);
}

/* out = x . W^T (+ bias) (+ residual), rows of the matrix's width apart. */
static int linear(const DecoderStep *s, const DecoderMatrix *w, const void *x,
                  const void *residual, void *out) {
    const int64_t stride = residual ? w->n : 0;
    switch (w->kind) {
        case LINEAR_NARROW:
            return chatsvc_narrow_linear(x, w->k, s->tokens, w->packed, w->format, w->scale, w->n,
                                         w->k, w->bias, residual, stride, out, w->n, 1,
                                         s->num_threads);
        case LINEAR_PAIRS:
            return chatsvc_pair_linear(x, w->k, s->tokens, w->packed, w->n, w->k, w->bias,
                                       residual, stride, out, w->n, s->num_threads);
        case LINEAR_TILES:
            return chatsvc_linear(x, w->k, s->tokens, w->packed, w->n, w->k, w->bias, residual,
                                  stride, out, w->n, s->num_threads);
        default:
            return -1;
    }
}

/* K and V rows of a token start q_size and q_size + kv_size into its qkv row. */
static void write_kv(const DecoderStep *s, int64_t layer, char *k_cache) {
    const int64_t D = s->head_dim, q_size = s->num_q_heads * D, kv_size = s->num_kv_heads * D;
    const int64_t row = q_size + 2 * kv_size;
    const void *key = at(s, s->qkv, q_size), *value = at(s, s->qkv, q_size + kv_size);
    char *v_cache = k_cache + s->v_bytes;
    if (!s->scales) {
        chatsvc_write_kv(key, row, D, value, row, D, k_cache, v_cache, s->kv_stride_block,
                         s->kv_stride_slot, s->kv_stride_head, s->slots, s->tokens,
                         s->num_kv_heads, D, s->block_size, s->dtype, s->kv_dtype);
        return;
    }
    char *k_scale = s->scales + layer * s->scale_layer_bytes;
    chatsvc_write_kv_int8(key, row, D, value, row, D, (int8_t *)k_cache, (int8_t *)v_cache,
                          s->kv_stride_block, s->kv_stride_slot, s->kv_stride_head,
                          (uint16_t *)k_scale, (uint16_t *)(k_scale + s->v_scale_bytes),
                          s->scale_stride_block, s->scale_stride_slot, s->scale_stride_head,
                          s->slots, s->tokens, s->num_kv_heads, D, s->block_size, s->dtype);
}

static int attention(const DecoderStep *s, int64_t layer, const char *k_cache) {
    const int64_t D = s->head_dim, q_size = s->num_q_heads * D;
    const int64_t row = q_size + 2 * s->num_kv_heads * D;
    const uint16_t *k_scale = NULL, *v_scale = NULL;
    if (s->scales) {
        const char *base = s->scales + layer * s->scale_layer_bytes;
        k_scale = (const uint16_t *)base;
        v_scale = (const uint16_t *)(base + s->v_scale_bytes);
    }
    return chatsvc_paged_attention(
        s->qkv, row, D, k_cache, k_cache + s->v_bytes, s->kv_stride_block, s->kv_stride_slot,
        s->kv_stride_head, k_scale, v_scale, s->scale_stride_block, s->scale_stride_slot,
        s->scale_stride_head, s->o, q_size, D, s->block_tables, s->table_stride, s->query_start,
        s->context_lens, s->seqs, s->num_seqs, (int32_t)s->num_q_heads,
        (int32_t)s->num_kv_heads, (int32_t)D, (int32_t)s->block_size, s->q_tile, s->span,
        s->scale_log2, s->dtype, s->kv_dtype, s->num_threads);
}

/* Run every layer. Returns 0; -1 where the attention found no memory for its scratch,
 * -2 where a linear did not run (no memory for its scratch, or no tile unit): the
 * step is then lost, as a failed call of the layer loop loses it. */
int chatsvc_decoder_layers(const DecoderStep *s) {
    const int64_t T = s->tokens, H = s->hidden, D = s->head_dim;
    const int64_t heads_qk = s->num_q_heads + s->num_kv_heads;
    const int64_t row = (heads_qk + s->num_kv_heads) * D;
    const int threads = s->num_threads, dtype = s->dtype;
    for (int64_t l = 0; l < s->num_layers; l++) {
        const DecoderLayer *w = s->layers + l;
        char *k_cache = s->kv + l * s->layer_bytes;
        chatsvc_rms_norm(s->h, H, w->input_norm, s->x, H, T, H, s->eps, dtype, threads);
        if (linear(s, &w->qkv, s->x, NULL, s->qkv)) return -2;
        chatsvc_rope(s->qkv, row, D, T, heads_qk, D, s->cos, s->sin, dtype, threads);
        write_kv(s, l, k_cache);
        if (attention(s, l, k_cache)) return -1;
        if (linear(s, &w->o, s->o, s->h, s->h2)) return -2;
        chatsvc_rms_norm(s->h2, H, w->post_norm, s->x, H, T, H, s->eps, dtype, threads);
        if (linear(s, &w->gate_up, s->x, NULL, s->gate_up)) return -2;
        chatsvc_swiglu(s->gate_up, 2 * s->intermediate, s->act, s->intermediate, T,
                       s->intermediate, dtype, threads);
        if (linear(s, &w->down, s->act, s->h2, s->h)) return -2;
    }
    return 0;
}

/* sizeof of the step and of a layer, for the Python mirror's check. */
void chatsvc_decoder_sizes(int64_t *step, int64_t *layer) {
    *step = (int64_t)sizeof(DecoderStep);
    *layer = (int64_t)sizeof(DecoderLayer);
}
