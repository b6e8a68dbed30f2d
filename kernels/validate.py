"""Shared input checks for the kernel launchers.

Every public kernel validates before it touches memory, so bad input raises a
``ValueError`` naming the argument instead of reading or writing out of bounds
(Triton does no bounds checking of its own).

Two kinds of checks:
- *metadata* checks (shapes, dtypes, devices, strides) are free: they never
  read tensor data;
- *value-range* checks (block ids inside the pool, slots in range, context
  lengths covered by the table) read index tensors, which on CUDA is a host
  sync. They run when ``check_bounds=True`` (the default); a hot path whose
  metadata comes from the trusted cache manager may pass ``False``.
"""

from __future__ import annotations

import torch

from kernels.kv_layout import QUANT_DTYPE, SCALE_DTYPE, KVScales, holds, is_quantized

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A KV cache holds values in a float dtype, or int8 rows with scales (kernels/kv_layout.py).
KV_DTYPES = (*FLOAT_DTYPES, QUANT_DTYPE)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check a layer's K/V caches; return ``(num_blocks, block_size, H_kv, D)``."""
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, H_kv, D], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    if k_cache.dtype not in KV_DTYPES:
        raise ValueError(f"KV cache dtype must be one of {KV_DTYPES}, got {k_cache.dtype}")
    if k_cache.device != v_cache.device:
        raise ValueError(f"k_cache on {k_cache.device} but v_cache on {v_cache.device}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis of the KV caches must be contiguous (stride 1)")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_kv_scales(k_cache: torch.Tensor, scales: KVScales | None) -> None:
    """An int8 cache needs its row scales (``[N, block_size, H_kv]`` bf16 beside it, K's
    and V's sharing strides: views of one pool); a float cache takes none."""
    if not is_quantized(k_cache.dtype):
        if scales is not None:
            raise ValueError(f"a {k_cache.dtype} KV cache takes no scales")
        return
    if scales is None:
        raise ValueError("an int8 KV cache needs its scales (kernels.kv_layout.scale_views)")
    for name, scale in zip(("k_scale", "v_scale"), scales, strict=True):
        if scale.shape != k_cache.shape[:3] or scale.dtype != SCALE_DTYPE:
            raise ValueError(
                f"{name} must be {tuple(k_cache.shape[:3])} {SCALE_DTYPE}, "
                f"got {tuple(scale.shape)} {scale.dtype}"
            )
        if scale.device != k_cache.device:
            raise ValueError(f"{name} on {scale.device} but the KV cache on {k_cache.device}")
    check_shared_strides(*scales)


def check_shared_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The compiled kernels (C, Triton) address K and V with one set of strides."""
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides (views of one pool)")


def check_query(query: torch.Tensor, k_cache: torch.Tensor, name: str = "query") -> int:
    """Check a ``[N, H_q, D]`` query against the caches; return the GQA group size."""
    if query.dim() != 3:
        raise ValueError(f"{name} must be 3-D [N, H_q, D], got shape {tuple(query.shape)}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} dtype must be one of {FLOAT_DTYPES}, got {query.dtype}")
    if not holds(k_cache.dtype, query.dtype):
        raise ValueError(
            f"a {k_cache.dtype} KV cache does not hold {name} dtype {query.dtype}'s K/V "
            "(its own dtype, int8, or bf16 for fp32)"
        )
    if query.device != k_cache.device:
        raise ValueError(f"{name} on {query.device} but the KV cache on {k_cache.device}")
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"{name} head_dim {head_dim} != KV cache head_dim {k_cache.shape[3]}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"H_q ({num_q_heads}) must be a multiple of H_kv ({num_kv_heads}) for GQA")
    return num_q_heads // num_kv_heads


def check_index(name: str, tensor: torch.Tensor, ndim: int, device: torch.device) -> None:
    """Check an integer metadata tensor's rank, dtype and device."""
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} on {tensor.device} but the KV cache on {device}")


def check_scale(scale: float) -> float:
    scale = float(scale)
    if not scale > 0.0 or scale == float("inf"):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return scale


def check_block_tables(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_blocks: int,
    block_size: int,
    min_context_lens: torch.Tensor | None = None,
) -> None:
    """Value-range checks of a batch's tables (reads data: a host sync on CUDA).

    Every sequence needs ``min_context_lens <= context_len <= max_blocks *
    block_size`` (``min_context_lens`` defaults to 1), and each table entry that
    covers one of its tokens must be a block id inside the pool. Entries past a
    sequence's last block are padding and may hold anything (e.g. -1).
    """
    lens = context_lens.long()
    lower = torch.ones_like(lens) if min_context_lens is None else min_context_lens.long()
    capacity = block_tables.shape[1] * block_size
    bad_lens = (lens < lower) | (lens > capacity)
    used_blocks = (lens.clamp(0, capacity) + block_size - 1) // block_size
    column = torch.arange(block_tables.shape[1], device=block_tables.device)
    in_use = column[None, :] < used_blocks[:, None]
    ids = block_tables.long()
    bad_ids = in_use & ((ids < 0) | (ids >= num_blocks))
    # One host sync when all is well; the diagnosis below only runs on failure.
    if not bool(bad_lens.any() | bad_ids.any()):
        return
    if bool(bad_lens.any()):
        b = int(bad_lens.nonzero()[0, 0])
        raise ValueError(
            f"context_lens[{b}] = {int(lens[b])} is outside [{int(lower[b])}, {capacity}] "
            f"(the table holds {block_tables.shape[1]} blocks of {block_size} tokens)"
        )
    b, i = (int(x) for x in bad_ids.nonzero()[0])
    raise ValueError(
        f"block_tables[{b}, {i}] = {int(ids[b, i])} is not a block of the pool "
        f"(num_blocks = {num_blocks})"
    )


def check_linear_inputs(
    x: torch.Tensor,
    shape: tuple[int, int],
    dtype: torch.dtype,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> None:
    """The native linears' inputs against a ``[N, K]`` weight: ``x [M, K]``, ``bias [N]``,
    ``residual [M, N]``, all ``dtype`` with unit stride along their last axis."""
    n, k = shape
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))
    if x.dim() != 2 or x.shape[1] != k or x.dtype != dtype or x.stride(1) != 1:
        raise ValueError(
            f"x must be [M, {k}] {name} with unit stride along K, got {tuple(x.shape)} {x.dtype}"
        )
    if bias is not None and (bias.shape != (n,) or bias.dtype != dtype or bias.stride(0) != 1):
        raise ValueError(f"bias must be [{n}] {name}, got {tuple(bias.shape)} {bias.dtype}")
    if residual is not None and (
        residual.shape != (x.shape[0], n) or residual.dtype != dtype or residual.stride(1) != 1
    ):
        got = f"{tuple(residual.shape)} {residual.dtype}"
        raise ValueError(f"residual must be [{x.shape[0]}, {n}] {name}, got {got}")
