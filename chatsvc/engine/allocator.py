"""glibc malloc settings for serving: keep mid-size buffers off fresh pages.

A forward pass allocates and frees many activation buffers of 100 KB-10 MB
(fp32 copies in RMSNorm, gathered K/V, MLP outputs). glibc serves blocks above
its mmap threshold (128 KB at start) with a fresh ``mmap`` and returns them with
``munmap``, so every such op also pays page faults on memory it just freed. With
the threshold at 32 MB (glibc's documented maximum on 64-bit) they are reused
from the heap, which shortens a step (measured in docs/engine.md, "malloc"). The
trim threshold bounds how much freed heap stays mapped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 64 << 20


def keep_freed_memory() -> bool:
    """Apply the settings (process-wide); False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt to call
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
