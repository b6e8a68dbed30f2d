"""KV write: scatter the K/V rows of new tokens into their cache slots.

A slot is ``block * block_size + offset``; ``-1`` marks a token whose K/V is
not stored (padding). The caches are one layer's strided views of the pool
(``kv_layout.layer_views``), written in place.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu import native
from kernels.step.write_index import WriteIndex, write_index
from kernels.triton_compat import runnable, tl, triton
from kernels.validate import check_index, check_kv_caches, check_shared_strides


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
):
    # One program per token: its [H_kv, D] row goes to one slot.
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
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def check_write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    check_bounds: bool = True,
) -> None:
    """Raise ``ValueError`` unless the arguments of ``write_kv`` are consistent."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_caches(k_cache, v_cache)
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key must be [T, {num_kv_heads}, {head_dim}], got shape {tuple(key.shape)}"
        )
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != KV cache dtype {k_cache.dtype}")
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
) -> None:
    """Reference: indexed assignment through (block, offset) pairs, in place.

    ``index`` (from ``write_index``; built here when None) lets a step's layers
    share one split of the slots.
    """
    if index is None:
        index = write_index(slot_mapping, k_cache.shape[1])
    if index.keep is not None:
        key, value = key[index.keep], value[index.keep]
    k_cache[index.blocks, index.offsets] = key
    v_cache[index.blocks, index.offsets] = value


def write_kv_native(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    lib: ctypes.CDLL | None = None,
) -> None:
    """Row copies in C (``kernels/cpu/write_kv.c``), in place (inputs already checked).
    ``lib``: the library where the caller resolved it once (default ``native.require()``)."""
    check_shared_strides(k_cache, v_cache)
    launch_write_kv(
        native.require() if lib is None else lib,
        key,
        value,
        (k_cache.data_ptr(), v_cache.data_ptr()),
        k_cache.stride()[:3],
        slot_mapping.to(torch.int64).contiguous(),
        k_cache.shape[1],
    )


def launch_write_kv(
    lib: ctypes.CDLL,
    key: torch.Tensor,
    value: torch.Tensor,
    caches: tuple[int, int],
    cache_strides: tuple[int, int, int],
    slots: torch.Tensor,
    block_size: int,
) -> None:
    """The C call alone: caches by address (K, V) and their shared (block, slot, head)
    strides in elements; ``slots`` int64 and contiguous. ``kernels.step.native_step`` calls
    it with a step's slots converted once."""
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
        key.element_size(),
    )


def write_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch ``write_kv_kernel``: one program per token (inputs already checked)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    check_shared_strides(k_cache, v_cache)
    kernel = runnable(write_kv_kernel, key.device)
    kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        DIM_P2=triton.next_power_of_2(head_dim),
        LOG2_BLOCK=block_size.bit_length() - 1,
    )
