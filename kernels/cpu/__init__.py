"""The native CPU kernels: C loops compiled on first use, and their Python side.

    native.py        builds the C files here into one library and loads it (ctypes)
    attention.py     paged attention through the C kernel (attention*.c, attention.h)
    tile_linear.py   bf16 linears on the tile unit (AMX) (tile_linear.c)
    write_kv.c       the KV write; layers.c: RMSNorm, RoPE, SwiGLU (their Python side
                     is the per-op files in ``kernels/``)
    common.h         bf16 conversions and the vectorisable exp2; amx.h: the tile setup

The C code trusts its arguments: the Python side checks them before each call.
"""
