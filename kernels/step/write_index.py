"""Index tensors the torch path derives from a step's slots, built once per step.

Every layer of a step writes to the same slots, so the split of slots into
(block, offset) is the same in all of them: the model builds it once and passes
it to ``write_kv`` of every layer (30 layers reuse one build), like the attention
groups of ``kernels.extend_metadata``. The Triton path ignores both: its kernels
read the raw tensors themselves.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class WriteIndex(NamedTuple):
    """Where ``write_kv`` stores each token: ``cache[blocks, offsets] = rows[keep]``.

    keep: ``[T]`` bool of the rows with a slot, or None when every row has one.
    """

    block_size: int
    blocks: torch.Tensor  # [T'] int64
    offsets: torch.Tensor  # [T'] int64
    keep: torch.Tensor | None


def write_index(slot_mapping: torch.Tensor, block_size: int) -> WriteIndex:
    """Split ``slot_mapping [T]`` into (block, offset) pairs once for all layers."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if bool(keep.all()):
        keep = None
    else:
        slots = slots[keep]
    return WriteIndex(block_size, slots // block_size, slots % block_size, keep)


def check_write_index(index: WriteIndex, num_tokens: int, block_size: int) -> None:
    """Raise ``ValueError`` unless ``index`` was built for this many tokens and block size."""
    if not isinstance(index, WriteIndex):
        raise ValueError(f"index must be a WriteIndex, got {type(index).__name__}")
    if index.block_size != block_size:
        raise ValueError(f"index built for block_size {index.block_size}, cache has {block_size}")
    num_rows = index.blocks.shape[0] if index.keep is None else index.keep.shape[0]
    if num_rows != num_tokens:
        raise ValueError(f"index built for {num_rows} tokens, got {num_tokens}")
