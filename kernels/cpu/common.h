/* Helpers the C kernels (kernels/cpu/*.c) share: bf16 <-> fp32 and a vectorisable exp2. */

#ifndef CHATSVC_CPU_COMMON_H
#define CHATSVC_CPU_COMMON_H

#include <stdint.h>
#include <string.h>

/* kernels/cpu/native.py: DTYPE_CODES; int8 only for KV caches (KV_DTYPE_CODES). */
enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_INT8 = 2 };

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch narrows fp32 to bf16; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Coefficients of 2^f for |f| <= 1/2 (Taylor, degree 7), highest first. */
static const float EXP2_TAYLOR[8] = {
    1.5252733804059838e-05f, 1.5403530393381606e-04f, 1.3333558146428441e-03f,
    9.6181291076284772e-03f, 5.5504108664821576e-02f, 2.4022650695910071e-01f,
    6.9314718055994531e-01f, 1.0f,
};

/* 2^x for x <= 0 (clamped at -126), written so loops over it vectorise (libm's exp2f
 * does not): x = n + f with n an integer and |f| <= 1/2, 2^f by its Taylor series
 * (truncation error < 1e-8), 2^n from the exponent bits. */
static inline float exp2_nonpositive(float x) {
    x = x < -126.0f ? -126.0f : x;
    const float n = __builtin_floorf(x + 0.5f);
    const float f = x - n;
    float p = EXP2_TAYLOR[0];
    for (int c = 1; c < 8; c++) p = p * f + EXP2_TAYLOR[c];
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
