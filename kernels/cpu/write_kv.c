/* KV write on the CPU: each token's K and V rows into its slot of the paged cache.
 *
 * torch's indexed assignment (two index_put calls, after a gather of the rows
 * to keep) costs tens of microseconds per layer for a handful of tokens; this is
 * a row copy per token and head. Slot -1 skips the token. Arguments (slots in
 * range and distinct) are checked by kernels/write_kv.py.
 */

#include <stdint.h>
#include <string.h>

void chatsvc_write_kv(const void *key, int64_t key_stride_t, int64_t key_stride_h,
                      const void *value, int64_t value_stride_t, int64_t value_stride_h,
                      void *k_cache, void *v_cache, int64_t stride_block, int64_t stride_slot,
                      int64_t stride_head, const int64_t *slots, int64_t tokens, int64_t heads,
                      int64_t head_dim, int64_t block_size, int64_t item_size) {
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t row = (slot / block_size) * stride_block + (slot % block_size) * stride_slot;
        for (int64_t h = 0; h < heads; h++) {
            const int64_t dst = (row + h * stride_head) * item_size;
            memcpy((char *)k_cache + dst,
                   (const char *)key + (t * key_stride_t + h * key_stride_h) * item_size,
                   head_dim * item_size);
            memcpy((char *)v_cache + dst,
                   (const char *)value + (t * value_stride_t + h * value_stride_h) * item_size,
                   head_dim * item_size);
        }
    }
}
