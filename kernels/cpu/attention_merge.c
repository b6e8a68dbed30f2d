/* The merge of a tile's pieces: a sequence split into slices of its keys (one long
 * decode keeps every thread busy) and a shared-prefix member (the shared item plus
 * its own keys) leave partial states (m, l, acc) per row, combined here as
 * flash-decoding does. */

#include "attention.h"

/* Merge the pieces of one tile: out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p. */
void merge_tile(const Args *a, const Tile *tile, const int64_t *parts, const float *partials,
                int head_dim) {
    const int Hq = a->num_q_heads, D = head_dim;
    const int32_t start = a->query_start[tile->seq];
    const int rows = (tile->q_end - tile->q_begin) * Hq;
    const int64_t *own = parts + tile->first_part;
    float acc[D];
    for (int r = 0; r < rows; r++) {
        float top = -INFINITY;
        for (int p = 0; p < tile->num_parts; p++) {
            const float mp = partials[(own[p] + r) * (D + 2)];
            top = mp > top ? mp : top;
        }
        float total = 0.0f;
        for (int d = 0; d < D; d++) acc[d] = 0.0f;
        for (int p = 0; p < tile->num_parts; p++) {
            const float *part = partials + (own[p] + r) * (D + 2);
            if (part[1] == 0.0f) continue; /* the piece lies wholly after this row */
            const float w = exp2_nonpositive(part[0] - top);
            total += w * part[1];
#pragma omp simd
            for (int d = 0; d < D; d++) acc[d] += w * part[2 + d];
        }
        const int i = tile->q_begin + r / Hq, head = r % Hq;
        const int64_t offset =
            (int64_t)(start + i) * a->out_stride_t + (int64_t)head * a->out_stride_h;
        const float inv = 1.0f / total;
        if (a->dtype == DTYPE_F32) {
            float *dst = (float *)a->out + offset;
            for (int d = 0; d < D; d++) dst[d] = acc[d] * inv;
        } else {
            uint16_t *dst = (uint16_t *)a->out + offset;
            for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(acc[d] * inv);
        }
    }
}
