/* The library's entry points that its own C code calls as well as Python
 * (`chatsvc_decoder_layers` composes them, decoder.c). The files that define them
 * include this too, so a changed signature fails the build, not a step. Arguments
 * as documented where each is defined. */

#ifndef CHATSVC_CPU_EXPORTS_H
#define CHATSVC_CPU_EXPORTS_H

#include <stdint.h>

void chatsvc_rms_norm(const void *x, int64_t x_stride, const void *weight, void *out,
                      int64_t out_stride, int64_t rows, int64_t hidden, float eps, int32_t dtype,
                      int32_t num_threads);

void chatsvc_rope(void *x, int64_t row_stride, int64_t head_stride, int64_t rows,
                  int64_t heads, int64_t head_dim, const void *cos, const void *sin,
                  int32_t dtype, int32_t num_threads);

void chatsvc_swiglu(const void *gate_up, int64_t in_stride, void *out, int64_t out_stride,
                    int64_t rows, int64_t inter, int32_t dtype, int32_t num_threads);

void chatsvc_write_kv(const void *key, int64_t key_stride_t, int64_t key_stride_h,
                      const void *value, int64_t value_stride_t, int64_t value_stride_h,
                      void *k_cache, void *v_cache, int64_t stride_block, int64_t stride_slot,
                      int64_t stride_head, const int64_t *slots, int64_t tokens, int64_t heads,
                      int64_t head_dim, int64_t block_size, int32_t dtype, int32_t kv_dtype);

void chatsvc_write_kv_int8(const void *key, int64_t key_stride_t, int64_t key_stride_h,
                           const void *value, int64_t value_stride_t, int64_t value_stride_h,
                           int8_t *k_cache, int8_t *v_cache, int64_t stride_block,
                           int64_t stride_slot, int64_t stride_head, uint16_t *k_scale,
                           uint16_t *v_scale, int64_t scale_stride_block,
                           int64_t scale_stride_slot, int64_t scale_stride_head,
                           const int64_t *slots, int64_t tokens, int64_t heads, int64_t head_dim,
                           int64_t block_size, int32_t dtype);

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
                            int32_t dtype, int32_t kv_dtype, int32_t num_threads);

int chatsvc_narrow_linear(const float *x, int64_t x_stride, int64_t m, const void *packed,
                          int32_t format, const float *scale, int64_t n, int64_t k,
                          const float *bias, const float *residual, int64_t residual_stride,
                          float *out, int64_t out_stride, int32_t wide_tiles,
                          int32_t num_threads);

int chatsvc_linear(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                   int64_t n, int64_t k, const uint16_t *bias, const uint16_t *residual,
                   int64_t residual_stride, uint16_t *out, int64_t out_stride,
                   int32_t num_threads);

int chatsvc_pair_linear(const uint16_t *x, int64_t x_stride, int64_t m, const uint16_t *packed,
                        int64_t n, int64_t k, const uint16_t *bias, const uint16_t *residual,
                        int64_t residual_stride, uint16_t *out, int64_t out_stride,
                        int32_t num_threads);

#endif
