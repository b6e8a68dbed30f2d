"""Batched block copy: copy-on-write within a pool and swaps between tiers.

A block is one contiguous chunk of ``block_numel`` elements across all layers
(``kv_layout``), so a copy is ``dst_pool[d] = src_pool[s]`` per pair; an int8 pool's
scales lie inside their block, so they move with its rows.

- Same CUDA device (copy-on-write, or two device pools): one Triton launch for
  the whole list, grid ``(num_pairs, ceil(block_numel / CHUNK))``, asynchronous
  on the current stream.
- Device <-> host (tier swaps): Triton cannot address host memory, so each
  block is one ``Tensor.copy_(..., non_blocking=True)``. A block is contiguous
  and the host tier is pinned when CUDA is present, so every copy is a single
  asynchronous DMA on the current stream. Device work queued after it on that
  stream is ordered behind it; host code that reads a swapped-out block must
  first wait for the stream (an event), since the call returns before the data
  has landed.
- CPU pools: the torch reference (gather, then indexed assignment).

Within one pool a destination may not also be a source of the same call: the
Triton launch gives no order between pairs. Copy-on-write never needs that
(its destinations are fresh blocks).
"""

from __future__ import annotations

import torch

from kernels.triton_compat import runnable, tl, triton
from kernels.validate import INDEX_DTYPES, KV_DTYPES

_CHUNK = 4096


@triton.jit
def copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    pairs_ptr,
    block_numel,
    stride_src,
    stride_dst,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < block_numel
    data = tl.load(src_ptr + src * stride_src + offsets, mask=mask)
    tl.store(dst_ptr + dst * stride_dst + offsets, data, mask=mask)


def _is_block_contiguous(pool: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(pool.shape[1:]), reversed(pool.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def check_copy_blocks(
    src_pool: torch.Tensor,
    dst_pool: torch.Tensor,
    pairs: torch.Tensor,
    check_bounds: bool = True,
) -> None:
    """Raise ``ValueError`` unless ``copy_blocks`` can run on these arguments."""
    for name, pool in (("src_pool", src_pool), ("dst_pool", dst_pool)):
        if pool.dim() < 2:
            raise ValueError(f"{name} must be [num_blocks, ...], got shape {tuple(pool.shape)}")
        if pool.dtype not in KV_DTYPES:
            raise ValueError(f"{name} dtype must be one of {KV_DTYPES}, got {pool.dtype}")
        if not _is_block_contiguous(pool):
            raise ValueError(f"each block of {name} must be one contiguous chunk")
    if src_pool.shape[1:] != dst_pool.shape[1:]:
        raise ValueError(
            f"block shapes differ: src {tuple(src_pool.shape[1:])}, dst {tuple(dst_pool.shape[1:])}"
        )
    if src_pool.dtype != dst_pool.dtype:
        raise ValueError(f"src_pool dtype {src_pool.dtype} != dst_pool dtype {dst_pool.dtype}")
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError(f"pairs must be [N, 2] (src, dst), got shape {tuple(pairs.shape)}")
    if pairs.dtype not in INDEX_DTYPES:
        raise ValueError(f"pairs must be int32 or int64, got {pairs.dtype}")
    if pairs.device.type != "cpu" and pairs.device not in (src_pool.device, dst_pool.device):
        raise ValueError(f"pairs on {pairs.device}: must be on the CPU or beside a pool")
    if not check_bounds or pairs.shape[0] == 0:
        return
    ids = pairs.long().cpu()
    for column, name, pool in ((0, "source", src_pool), (1, "destination", dst_pool)):
        bad = (ids[:, column] < 0) | (ids[:, column] >= pool.shape[0])
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"pairs[{i}] {name} block {int(ids[i, column])} is outside [0, {pool.shape[0]})"
            )
    dsts = ids[:, 1]
    if torch.unique(dsts).numel() != dsts.numel():
        raise ValueError("pairs name the same destination block twice")
    if src_pool.data_ptr() == dst_pool.data_ptr() and bool(torch.isin(dsts, ids[:, 0]).any()):
        raise ValueError("within one pool, a destination block may not also be a source")


def copy_blocks_torch(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """Reference and host path: ``dst_pool[d] = src_pool[s]`` for every pair."""
    if pairs.shape[0] == 0:
        return
    if src_pool.device == dst_pool.device:
        ids = pairs.long().to(src_pool.device)
        dst_pool[ids[:, 1]] = src_pool[ids[:, 0]]
        return
    # Across devices: block-sized copies keep each transfer one asynchronous
    # DMA from/to pinned memory; a gather would stage through pageable memory.
    for src, dst in pairs.long().tolist():
        dst_pool[dst].copy_(src_pool[src], non_blocking=True)


def copy_blocks_triton(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: torch.Tensor) -> None:
    """One launch of ``copy_blocks_kernel`` for all pairs (pools on one device)."""
    if src_pool.device != dst_pool.device:
        raise ValueError("the triton copy needs both pools on one device; use the torch path")
    num_pairs = pairs.shape[0]
    if num_pairs == 0:
        return
    pairs = pairs.to(device=src_pool.device, dtype=torch.int64, non_blocking=True).contiguous()
    block_numel = src_pool[0].numel()
    grid = (num_pairs, triton.cdiv(block_numel, _CHUNK))
    runnable(copy_blocks_kernel, src_pool.device)[grid](
        src_pool,
        dst_pool,
        pairs,
        block_numel,
        src_pool.stride(0),
        dst_pool.stride(0),
        CHUNK=_CHUNK,
    )
