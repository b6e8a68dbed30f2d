/* Packing of the narrow-weight linears' matrices (narrow_linear.c describes the layout):
 * once per matrix at load, so plain loops; no CPU features needed. */

#include <stdint.h>
#include <string.h>

#include "narrow_linear.h"

/* Elements (of the format's width) of W [n, k] once packed. */
int64_t chatsvc_narrow_linear_packed_elements(int64_t n, int64_t k) {
    return (n + COLS - 1) / COLS * COLS * k;
}

/* int8 and fp32 */
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

/* Pack q [n, k] (int8, rows `q_stride` apart) into `packed`. */
void chatsvc_narrow_linear_pack_int8(const int8_t *q, int64_t q_stride, int64_t n, int64_t k,
                                     int8_t *packed) {
    pack_blocks((const char *)q, q_stride, n, k, 1, IDENTITY_COLUMN_OF, (char *)packed);
}

/* Pack W [n, k] (fp32, rows `w_stride` apart) into `packed`. */
void chatsvc_narrow_linear_pack_f32(const float *w, int64_t w_stride, int64_t n, int64_t k,
                                    float *packed) {
    pack_blocks((const char *)w, w_stride, n, k, 4, IDENTITY_COLUMN_OF, (char *)packed);
}
