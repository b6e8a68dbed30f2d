/* KV write on the CPU: each token's K and V rows into its slot of the paged cache.
 *
 * torch's indexed assignment (two index_put calls, after a gather of the rows
 * to keep) costs tens of microseconds per layer for a handful of tokens; this is
 * a row copy per token and head (an fp32 row into a bf16 cache rounded on the way; for an
 * int8 cache, a row quantized per token and head: `chatsvc_write_kv_int8`). Slot -1 skips
 * the token. Arguments (slots in range and distinct) are checked by kernels/write_kv.py.
 */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "exports.h"

/* One row of `n` values from `src` (`dtype`) into `dst` (`kv_dtype`): copied, or an fp32
 * model's row rounded to bf16 (nearest even, as torch narrows). */
static void store_row(void *dst, const void *src, int64_t n, int32_t dtype, int32_t kv_dtype) {
    if (dtype == kv_dtype) {
        memcpy(dst, src, (size_t)n * (dtype == DTYPE_F32 ? 4 : 2));
        return;
    }
    const float *from = src;
    uint16_t *to = dst;
    for (int64_t i = 0; i < n; i++) to[i] = f32_to_bf16(from[i]);
}

void chatsvc_write_kv(const void *key, int64_t key_stride_t, int64_t key_stride_h,
                      const void *value, int64_t value_stride_t, int64_t value_stride_h,
                      void *k_cache, void *v_cache, int64_t stride_block, int64_t stride_slot,
                      int64_t stride_head, const int64_t *slots, int64_t tokens, int64_t heads,
                      int64_t head_dim, int64_t block_size, int32_t dtype, int32_t kv_dtype) {
    const int64_t item = dtype == DTYPE_F32 ? 4 : 2, kv_item = kv_dtype == DTYPE_F32 ? 4 : 2;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t row = (slot / block_size) * stride_block + (slot % block_size) * stride_slot;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t dst = (row + h * stride_head) * kv_item;
            store_row((char *)k_cache + dst,
                      (const char *)key + (t * key_stride_t + h * key_stride_h) * item, head_dim,
                      dtype, kv_dtype);
            store_row((char *)v_cache + dst,
                      (const char *)value + (t * value_stride_t + h * value_stride_h) * item,
                      head_dim, dtype, kv_dtype);
        }
    }
}

/* int8 KV (kernels/kv_quant.py is the reference, bit for bit): each (token, head) row
 * of K and V quantized on its own, scale = max|x| / 127 rounded up to bf16, q =
 * round-half-even(x / scale) by one fp32 division per value. A row holding NaN keeps a
 * NaN scale (and zeros), so a read sees NaN as a float cache would hold it. */

static inline uint16_t scale_up_bf16(float s) {
    uint32_t bits;
    memcpy(&bits, &s, sizeof bits);
    if (s != s) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0xffffu) >> 16);
}

static void quantize_row(const void *src, int32_t dtype, int64_t n, int8_t *dst, uint16_t *scale) {
    float x[n];
    if (dtype == DTYPE_F32) {
        memcpy(x, src, sizeof(float) * n);
    } else {
        for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(((const uint16_t *)src)[i]);
    }
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        amax = (a > amax || a != a) && amax == amax ? a : amax;
    }
    const uint16_t stored = scale_up_bf16(amax / 127.0f);
    const float s = bf16_to_f32(stored);
    *scale = stored;
    for (int64_t i = 0; i < n; i++) {
        float q = s > 0.0f ? rintf(x[i] / s) : 0.0f;
        q = q != q ? 0.0f : q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        dst[i] = (int8_t)q;
    }
}

void chatsvc_write_kv_int8(const void *key, int64_t key_stride_t, int64_t key_stride_h,
                           const void *value, int64_t value_stride_t, int64_t value_stride_h,
                           int8_t *k_cache, int8_t *v_cache, int64_t stride_block,
                           int64_t stride_slot, int64_t stride_head, uint16_t *k_scale,
                           uint16_t *v_scale, int64_t scale_stride_block,
                           int64_t scale_stride_slot, int64_t scale_stride_head,
                           const int64_t *slots, int64_t tokens, int64_t heads, int64_t head_dim,
                           int64_t block_size, int32_t dtype) {
    const int64_t item = dtype == DTYPE_F32 ? 4 : 2;
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t block = slot / block_size, offset = slot % block_size;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t row = block * stride_block + offset * stride_slot + h * stride_head;
            const int64_t at =
                block * scale_stride_block + offset * scale_stride_slot + h * scale_stride_head;
            quantize_row((const char *)key + (t * key_stride_t + h * key_stride_h) * item, dtype,
                         head_dim, k_cache + row, k_scale + at);
            quantize_row((const char *)value + (t * value_stride_t + h * value_stride_h) * item,
                         dtype, head_dim, v_cache + row, v_scale + at);
        }
    }
}
