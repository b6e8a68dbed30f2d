/* Packing of the narrow-weight linears' matrices (narrow_linear.c describes the bf16 and
 * fp32 layout, narrow_int8.c int8's): once per matrix at load, so plain loops; no CPU
 * features needed. */

#include <stdint.h>
#include <string.h>

#include "narrow_linear.h"

/* Elements (of the format's width) of W [n, k] once packed in `format`. */
int64_t chatsvc_narrow_linear_packed_elements(int64_t n, int64_t k, int32_t format) {
    return (n + COLS - 1) / COLS * COLS * (format == FORMAT_INT8 ? int8_padded_k(k) : k);
}

/* fp32 */
static const int IDENTITY_COLUMN_OF[COLS] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* The packed layout above for elements of `width` bytes, block place p taking row
 * 16 nb + column_of[p]. */
static void pack_blocks(const char *w, int64_t w_stride, int64_t n, int64_t k, int width,
                        const int *column_of, char *packed) {
    const int64_t nbs = (n + COLS - 1) / COLS;
    for (int64_t nb = 0; nb < nbs; nb++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int p = 0; p < COLS; p++) {
                const int64_t row = nb * COLS + column_of[p];
                char *dst = packed + ((nb * k + kk) * COLS + p) * width;
                if (row < n)
                    memcpy(dst, w + (row * w_stride + kk) * width, (size_t)width);
                else
                    memset(dst, 0, (size_t)width);
            }
}

/* Pack W [n, k] (bf16, rows `w_stride` elements apart) into `packed`. */
void chatsvc_narrow_linear_pack_bf16(const uint16_t *w, int64_t w_stride, int64_t n, int64_t k,
                                     uint16_t *packed) {
    pack_blocks((const char *)w, w_stride, n, k, 2, BF16_COLUMN_OF, (char *)packed);
}

/* Pack q [n, k] (int8 in [-127, 127], rows `q_stride` apart) into `packed`, offset to
 * unsigned bytes; past row n and column k the bytes of 0. */
void chatsvc_narrow_linear_pack_int8(const int8_t *q, int64_t q_stride, int64_t n, int64_t k,
                                     uint8_t *packed) {
    const int64_t nbs = (n + COLS - 1) / COLS, kp = int8_padded_k(k);
    for (int64_t nb = 0; nb < nbs; nb++)
        for (int64_t kq = 0; kq < kp / 4; kq++)
            for (int c = 0; c < COLS; c++)
                for (int j = 0; j < 4; j++) {
                    const int64_t row = nb * COLS + c, col = kq * 4 + j;
                    const int value = row < n && col < k ? q[row * q_stride + col] : 0;
                    packed[((nb * kp / 4 + kq) * COLS + c) * 4 + j] = (uint8_t)(value + 128);
                }
}

/* Pack W [n, k] (fp32, rows `w_stride` apart) into `packed`. */
void chatsvc_narrow_linear_pack_f32(const float *w, int64_t w_stride, int64_t n, int64_t k,
                                    float *packed) {
    pack_blocks((const char *)w, w_stride, n, k, 4, IDENTITY_COLUMN_OF, (char *)packed);
}
