"""The KV-cache memory layout: the one place it is defined.

Every tier (device and host) is a single tensor:

    pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
            ^ block     ^ layer     ^ 0 = K, 1 = V
                                       ^ token offset inside the block

Why this order:
- A block is one contiguous chunk across all layers, so copy-on-write and
  tier swaps are plain block copies: ``dst_pool[d] = src_pool[s]``.
- Within a layer, one token's K (or V) for all KV heads is contiguous
  (``num_kv_heads * head_dim`` elements), so a KV write is one row per token.
- Kernels address a layer through the strided views from ``layer_views``;
  they take strides from the tensor and never assume the pool is dense
  per layer.

A slot is ``block_id * block_size + offset`` (``-1`` = skip: padding).
Block sizes are powers of two so kernels split a slot with shifts and masks.
Block starts are 256-byte aligned: a block's byte size is
``num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize``, and
``new_kv_pool`` checks it is a multiple of 256 (the pool's base pointer is
allocator-aligned).

Refcounts and all other metadata live in host memory (cache/), never here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_ALIGN_BYTES = 256


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")

    def block_numel(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim

    def block_bytes(self, dtype: torch.dtype) -> int:
        return self.block_numel() * torch.empty((), dtype=dtype).element_size()


def new_kv_pool(
    num_blocks: int,
    shape: KVShape,
    dtype: torch.dtype,
    device: torch.device | str,
    pin_memory: bool = False,
) -> torch.Tensor:
    """Allocate one tier: ``[num_blocks, L, 2, block_size, H_kv, D]``, zeroed."""
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    nbytes = shape.block_bytes(dtype)
    if nbytes % BLOCK_ALIGN_BYTES:
        raise ValueError(
            f"a block is {nbytes} bytes, not a multiple of {BLOCK_ALIGN_BYTES}: "
            "choose a larger block_size"
        )
    dims = (num_blocks, shape.num_layers, 2, shape.block_size, shape.num_kv_heads, shape.head_dim)
    pin = pin_memory and torch.device(device).type == "cpu" and torch.cuda.is_available()
    return torch.zeros(dims, dtype=dtype, device=device, pin_memory=pin)


def layer_views(pool: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches of one layer, each ``[num_blocks, block_size, H_kv, D]`` (strided views)."""
    return pool[:, layer, 0], pool[:, layer, 1]
