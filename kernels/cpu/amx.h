/* The tile unit (AMX) for the C kernels that use it (kernels/cpu/attention.c,
 * kernels/cpu/tile_linear.c): CHATSVC_AMX is defined where the build targets a CPU with
 * AMX-BF16 and AVX512-BF16, and the setup every thread does before its first tile
 * instruction. `amx_usable()` exists in every build (0 without CHATSVC_AMX). */

#ifndef CHATSVC_CPU_AMX_H
#define CHATSVC_CPU_AMX_H

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CHATSVC_AMX 1

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int amx_permission; /* 0: not asked yet, 1: granted, -1: refused */

/* Linux hands out the tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XTILEDATA, once per process; torch's oneDNN asks too). */
static inline int amx_usable(void) {
    if (amx_permission == 0)
        amx_permission = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return amx_permission > 0;
}

/* Every tile 16 rows x 64 bytes; per thread, before its first tile instruction. */
static inline void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

#else

/* A build without the tile unit's instructions never uses it. */
static inline int amx_usable(void) { return 0; }

#endif
#endif
