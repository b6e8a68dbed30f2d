/* What the files of the narrow-weight linears share (kernels/cpu/narrow_linear*.c).
 *
 *   narrow_linear.c         the entry and the row tiles on AVX2 + FMA
 *   narrow_linear_avx512.c  the row tiles on AVX-512 (builds for CPUs that have it)
 *   narrow_int8.c           the int8 format: integer dot products against quantized x
 *   narrow_pack.c           the packing of a matrix into the blocks
 *
 * The tiles of a format sum every output the one way its file's comment describes
 * (bf16, fp32: narrow_linear.c; int8: narrow_int8.c), so a build's results do not
 * depend on which tiles ran them. Everything here trusts its arguments:
 * the Python wrapper (kernels/cpu/narrow_linear.py) checked them.
 */

#ifndef CHATSVC_CPU_NARROW_LINEAR_H
#define CHATSVC_CPU_NARROW_LINEAR_H

#include <stdint.h>

/* Functions one file of the library calls in another: not exported by the library. */
#define CHATSVC_NARROW_INTERNAL __attribute__((visibility("hidden")))

enum { COLS = 16 };
/* kernels/cpu/narrow_linear.py: FORMATS. */
enum { FORMAT_BF16 = 0, FORMAT_INT8 = 1, FORMAT_F32 = 2 };

/* int8: x is quantized with one scale per GROUP values of a row (narrow_int8.c), and K
 * is stored padded to a multiple of it. kernels/cpu/narrow_linear.py: ACTIVATION_GROUP. */
enum { GROUP = 32 };

static inline int64_t int8_padded_k(int64_t k) {
    return (k + GROUP - 1) / GROUP * GROUP;
}

/* Bytes of weights a thread keeps in its L2 while every row tile passes over them. */
enum { CHUNK_BYTES = 256 * 1024 };

/* Block place p of a packed bf16 block holds column BF16_COLUMN_OF[p] (narrow_linear.c);
 * the permutation is its own inverse. */
static const int BF16_COLUMN_OF[COLS] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

typedef struct {
    const float *x;
    int64_t x_stride, m;
    const void *packed;
    int format;
    int64_t n, k;
    const float *scale, *bias, *residual;
    int64_t residual_stride;
    float *out;
    int64_t out_stride;
} Problem;

/* Bytes per packed value of the bf16 and fp32 layouts (int8 has its own: narrow_int8.c). */
static inline int64_t format_width(int format) {
    return format == FORMAT_BF16 ? 2 : 4;
}

/* Column block nb's packed values (bf16, fp32). */
static inline const void *block_at(const Problem *p, int64_t nb) {
    return (const char *)p->packed + nb * p->k * COLS * format_width(p->format);
}

/* Blocks of weights per chunk: as many as CHUNK_BYTES hold, at least one. */
static inline int64_t chunk_blocks(const Problem *p, int64_t blocks) {
    if (p->k <= 0) return blocks > 0 ? blocks : 1;
    const int64_t chunk = CHUNK_BYTES / (p->k * COLS * format_width(p->format));
    return chunk < 1 ? 1 : chunk;
}

/* Lines [line * lines, (line + 1) * lines) of the next tile's `bytes` bytes at `next`
 * into L2 (none past `bytes`). A tile of `lines` blocks calls it once per cache line it
 * consumes of each block, so the next tile's weights arrive in address order while this
 * one runs: the interleaved streams of a tile's blocks, or even one block's stream, are
 * served worse by the hardware prefetchers alone (docs/kernels.md). */
static inline void prefetch_next_tile(const char *next, int64_t bytes, int64_t line, int lines) {
    for (int j = 0; j < lines; j++) {
        const int64_t at = (line * lines + j) * 64;
        if (at < bytes) __builtin_prefetch(next + at, 0, 2); /* prefetcht1: into L2 */
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* out for an int8 problem: its own layout and sums (narrow_int8.c). `wide` as in
 * chatsvc_narrow_linear. 0, or -1 where scratch memory ran out (nothing written). */
CHATSVC_NARROW_INTERNAL int narrow_int8_run(const Problem *p, int wide, int num_threads);
#endif

#if defined(__AVX512F__)
/* Column blocks [first, last) of out, all m rows, in the problem's own format. */
CHATSVC_NARROW_INTERNAL void narrow_blocks_avx512(const Problem *p, int64_t first, int64_t last);
#endif

#endif
