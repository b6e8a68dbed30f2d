"""KV write: scatter the K/V rows of new tokens into their cache slots.

A slot is ``block * block_size + offset``; ``-1`` marks a token whose K/V is
not stored (padding). The caches are one layer's strided views of the pool
(``kv_layout.layer_views``), written in place. A bf16 cache takes fp32 rows too (an
fp32 model's, ``kv_layout.holds``): each value rounded to nearest even, as torch's
``.to(torch.bfloat16)``. An int8 cache (``kv_layout``) takes its scale views too
(``KVScales``): each (token, head) row is quantized on its way in
(``kernels.kv_quant``, the reference every backend matches bit for bit).
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import native
from kernels.kv_layout import KVScales, holds, is_quantized
from kernels.kv_quant import QMAX, quantize_rows
from kernels.step.write_index import WriteIndex, write_index
from kernels.triton_compat import runnable, tl, triton
from kernels.validate import (
    FLOAT_DTYPES,
    check_index,
    check_kv_caches,
    check_kv_scales,
    check_shared_strides,
)


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    DIM_P2: tl.constexpr,
    LOG2_BLOCK: tl.constexpr,
    NARROW: tl.constexpr,
):
    # One program per token: its [H_kv, D] row goes to one slot. NARROW: fp32 rows into a
    # bf16 cache passed as int16, rounded here (the store's own cast may truncate).
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot >> LOG2_BLOCK
    offset = slot & ((1 << LOG2_BLOCK) - 1)
    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, DIM_P2)
    # A skipped token (slot -1) gets zero live heads. (Folding the scalar
    # predicate into the bound keeps the mask a vector compare, which the
    # interpreter also handles; a scalar `&` there yields an int32 mask.)
    num_live_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads[:, None] < num_live_heads) & (dims[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    if NARROW:
        k, v = _bf16_bits(k), _bf16_bits(v)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _bf16_bits(x):
    # fp32 -> bf16 bits (int16), nearest even as torch narrows; NaN stays NaN (quiet).
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, (bits >> 16) | 0x40, rounded).to(tl.int16)


@triton.jit
def _quantize_store(x, data_ptrs, scale_ptrs, mask, head_mask, QMAX: tl.constexpr):
    # x [heads, dims] fp32 (0 where masked) -> int8 rows and bf16 scales (kernels.kv_quant).
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    amax = tl.max(tl.abs(x), axis=1)
    bits = tl.math.div_rn(amax, QMAX * 1.0).to(tl.int32, bitcast=True)
    up = (bits + 0xFFFF) & -65536  # rounded up to bf16: |x / scale| <= QMAX
    up = tl.where(has_nan, 0x7FC00000, up)
    scale = up.to(tl.float32, bitcast=True)[:, None]
    q = tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0))
    # + 1.5 * 2^23 - 1.5 * 2^23: fp32 |q| < 2^22 rounded to an integer, half to even.
    q = (q + 12582912.0) - 12582912.0
    q = tl.where((scale > 0) & (q == q), q, 0.0)
    q = tl.minimum(tl.maximum(q, -QMAX * 1.0), QMAX * 1.0)
    tl.store(data_ptrs, q.to(tl.int8), mask=mask)
    tl.store(scale_ptrs, (up >> 16).to(tl.int16), mask=head_mask)


@triton.jit
def write_kv_int8_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    DIM_P2: tl.constexpr,
    LOG2_BLOCK: tl.constexpr,
    QMAX: tl.constexpr,
):
    # One program per token, as write_kv_kernel; each head's row quantized on its own.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot >> LOG2_BLOCK
    offset = slot & ((1 << LOG2_BLOCK) - 1)
    heads = tl.arange(0, HEADS_P2)
    dims = tl.arange(0, DIM_P2)
    num_live_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    head_mask = heads < num_live_heads
    mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    at = block * stride_sb + offset * stride_ss + heads * stride_sh
    k = tl.where(mask, k.to(tl.float32), 0.0)
    v = tl.where(mask, v.to(tl.float32), 0.0)
    _quantize_store(k, k_cache_ptr + dst, k_scale_ptr + at, mask, head_mask, QMAX)
    _quantize_store(v, v_cache_ptr + dst, v_scale_ptr + at, mask, head_mask, QMAX)


def check_write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    check_bounds: bool = True,
    scales: KVScales | None = None,
) -> None:
    """Raise ``ValueError`` unless the arguments of ``write_kv`` are consistent."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_caches(k_cache, v_cache)
    check_kv_scales(k_cache, scales)
    quantized = is_quantized(k_cache.dtype)
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key must be [T, {num_kv_heads}, {head_dim}], got shape {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    for name, t in (("key", key), ("value", value)):
        if quantized and t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be one of {FLOAT_DTYPES}, got {t.dtype}")
        if not quantized and not holds(k_cache.dtype, t.dtype):
            raise ValueError(
                f"a {k_cache.dtype} KV cache does not hold {name} dtype {t.dtype} "
                "(its own dtype, or fp32 into bf16)"
            )
        if t.device != k_cache.device:
            raise ValueError(f"{name} on {t.device} but the KV cache on {k_cache.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"the head_dim axis of {name} must be contiguous")
    check_index("slot_mapping", slot_mapping, 1, k_cache.device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens"
        )
    if not check_bounds or slot_mapping.numel() == 0:
        return
    slots = slot_mapping.long()
    limit = num_blocks * block_size
    bad = (slots < -1) | (slots >= limit)
    # Duplicates (two tokens racing for one slot) show up as equal neighbours
    # once sorted; -1 (skip) may repeat.
    ordered = slots.sort().values
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    if not bool(bad.any() | repeated.any()):  # one host sync when all is well
        return
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"slot_mapping[{i}] = {int(slots[i])} is outside [-1, {limit})")
    slot = int(ordered[1:][repeated][0])
    raise ValueError(f"slot_mapping writes the same slot twice (slot {slot})")


def write_kv_torch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    index: WriteIndex | None = None,
    scales: KVScales | None = None,
) -> None:
    """Reference: indexed assignment through (block, offset) pairs, in place (for an int8
    cache, of the rows ``kv_quant.quantize_rows`` makes, and their ``scales``).

    ``index`` (from ``write_index``; built here when None) lets a step's layers
    share one split of the slots.
    """
    if index is None:
        index = write_index(slot_mapping, k_cache.shape[1])
    if index.keep is not None:
        key, value = key[index.keep], value[index.keep]
    if scales is None:
        k_cache[index.blocks, index.offsets] = key.to(k_cache.dtype)
        v_cache[index.blocks, index.offsets] = value.to(v_cache.dtype)
        return
    for cache, scale, rows in ((k_cache, scales.k, key), (v_cache, scales.v, value)):
        q, s = quantize_rows(rows)
        cache[index.blocks, index.offsets] = q
        scale[index.blocks, index.offsets] = s


def write_kv_native(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    lib: ctypes.CDLL | None = None,
    scales: KVScales | None = None,
) -> None:
    """Row copies in C (``kernels/cpu/write_kv.c``), in place (inputs already checked);
    rows quantized for an int8 cache. ``lib``: the library where the caller resolved it
    once (default ``native.require()``)."""
    check_shared_strides(k_cache, v_cache)
    lib = native.require() if lib is None else lib
    caches = (k_cache.data_ptr(), v_cache.data_ptr()), k_cache.stride()[:3]
    slots = slot_mapping.to(torch.int64).contiguous()
    if scales is None:
        launch_write_kv(lib, key, value, *caches, slots, k_cache.shape[1], k_cache.dtype)
        return
    check_shared_strides(*scales)
    scale_args = (scales.k.data_ptr(), scales.v.data_ptr(), *scales.k.stride())
    launch_write_kv_int8(lib, key, value, *caches, scale_args, slots, k_cache.shape[1])


def launch_write_kv(
    lib: ctypes.CDLL,
    key: torch.Tensor,
    value: torch.Tensor,
    caches: tuple[int, int],
    cache_strides: tuple[int, int, int],
    slots: torch.Tensor,
    block_size: int,
    kv_dtype: torch.dtype,
) -> None:
    """The C call alone: caches of ``kv_dtype`` by address (K, V) and their shared (block,
    slot, head) strides in elements; ``slots`` int64 and contiguous.
    ``kernels.step.native_step`` calls it with a step's slots converted once."""
    lib.chatsvc_write_kv(
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        value.data_ptr(),
        value.stride(0),
        value.stride(1),
        *caches,
        *cache_strides,
        slots.data_ptr(),
        key.shape[0],
        key.shape[1],
        key.shape[2],
        block_size,
        native.DTYPE_CODES[key.dtype],
        native.DTYPE_CODES[kv_dtype],
    )


def launch_write_kv_int8(
    lib: ctypes.CDLL,
    key: torch.Tensor,
    value: torch.Tensor,
    caches: tuple[int, int],
    cache_strides: tuple[int, int, int],
    scales: tuple[int, int, int, int, int],
    slots: torch.Tensor,
    block_size: int,
) -> None:
    """The C call of an int8 cache: ``launch_write_kv``'s arguments and the scales' addresses
    (K, V) and shared (block, slot, head) strides in elements."""
    lib.chatsvc_write_kv_int8(
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        value.data_ptr(),
        value.stride(0),
        value.stride(1),
        *caches,
        *cache_strides,
        *scales,
        slots.data_ptr(),
        key.shape[0],
        key.shape[1],
        key.shape[2],
        block_size,
        native.DTYPE_CODES[key.dtype],
    )


def write_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: KVScales | None = None,
) -> None:
    """Launch ``write_kv_kernel`` (``write_kv_int8_kernel`` for an int8 cache): one program
    per token (inputs already checked)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_shared_strides(k_cache, v_cache)
    sizes = dict(
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        DIM_P2=triton.next_power_of_2(head_dim),
        LOG2_BLOCK=block_size.bit_length() - 1,
    )
    if scales is not None:
        check_shared_strides(*scales)
        runnable(write_kv_int8_kernel, key.device)[(num_tokens,)](
            key,
            value,
            k_cache,
            v_cache,
            scales.k.view(torch.int16),
            scales.v.view(torch.int16),
            slot_mapping,
            key.stride(0),
            key.stride(1),
            value.stride(0),
            value.stride(1),
            *k_cache.stride()[:3],
            *scales.k.stride(),
            QMAX=QMAX,
            **sizes,
        )
        return
    narrow = key.dtype != k_cache.dtype
    kernel = runnable(write_kv_kernel, key.device)
    kernel[(num_tokens,)](
        key,
        value,
        k_cache.view(torch.int16) if narrow else k_cache,
        v_cache.view(torch.int16) if narrow else v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NARROW=narrow,
        **sizes,
    )
