"""Index tensors the torch path derives from a step's slots and block tables, built once.

Every layer of a step writes to the same slots and attends through the same
block tables, so the split of slots into (block, offset), the decode gather
ids, the padding mask and the grouping of sequences are the same in all of
them. The runner builds them once per step and passes them to ``write_kv`` and
``paged_decode_attention`` of every layer (30 layers reuse one build). The
Triton path ignores them: its kernels read the raw tensors themselves.

Decode groups (block_size 4; the gather of a group stays under a byte budget)::

    group 0: seqs [0, 3)   ids [3, n0]   bias [3, 1, 1, n0 * 4]   n0: blocks of its longest
    group 1: seqs [3, 5)   ids [2, n1]   bias [2, 1, 1, n1 * 4]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.paged_gather import batch_block_ids, masked_scores_bias

# Gathered K of one decode group stays under this. Larger groups mean fewer, wider SDPA
# calls (16 MiB vs 4 MiB: batch 16 x 1k-token decode 99 -> 88 ms, 32 x 500 110 -> 99 ms,
# 2 threads, bf16); the cap keeps one group's K and V buffers to a few tens of MB.
GATHER_CHUNK_BYTES = 16 << 20


class WriteIndex(NamedTuple):
    """Where ``write_kv`` stores each token: ``cache[blocks, offsets] = rows[keep]``.

    keep: ``[T]`` bool of the rows with a slot, or None when every row has one.
    """

    block_size: int
    blocks: torch.Tensor  # [T'] int64
    offsets: torch.Tensor  # [T'] int64
    keep: torch.Tensor | None


class DecodeGroup(NamedTuple):
    """Sequences ``[start, end)`` of a decode batch, gathered and attended together."""

    start: int
    end: int
    ids: torch.Tensor  # [b, n] int64 block ids; padding past a sequence's blocks -> 0
    bias: torch.Tensor  # [b, 1, 1, n * block_size] additive mask: 0 inside, -inf past the end


class DecodeMetadata(NamedTuple):
    """The torch decode path's per-step indices (see the module docstring)."""

    block_size: int
    batch: int
    groups: tuple[DecodeGroup, ...]


def write_index(slot_mapping: torch.Tensor, block_size: int) -> WriteIndex:
    """Split ``slot_mapping [T]`` into (block, offset) pairs once for all layers."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if bool(keep.all()):
        keep = None
    else:
        slots = slots[keep]
    return WriteIndex(block_size, slots // block_size, slots % block_size, keep)


def decode_metadata(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    kv_row_bytes: int,
    dtype: torch.dtype,
) -> DecodeMetadata:
    """Groups, gather ids and padding masks of one decode step.

    kv_row_bytes: bytes of one token's K in one layer (``H_kv * D * itemsize``),
    which sizes the groups; dtype: the attention's dtype (the mask's).
    """
    lens = context_lens.tolist()
    batch = len(lens)
    groups = []
    start = 0
    while start < batch:
        end, longest = start + 1, lens[start]
        while end < batch:
            grown = max(longest, lens[end])
            if (end + 1 - start) * grown * kv_row_bytes > GATHER_CHUNK_BYTES:
                break
            end, longest = end + 1, grown
        group_lens = context_lens[start:end]
        ids, padded_len = batch_block_ids(block_tables[start:end], group_lens, block_size)
        positions = torch.arange(padded_len, device=context_lens.device)
        allowed = positions[None, :] < group_lens.long()[:, None]
        bias = masked_scores_bias(allowed, dtype)[:, None, None, :]
        groups.append(DecodeGroup(start, end, ids, bias))
        start = end
    return DecodeMetadata(block_size, batch, tuple(groups))


def check_write_index(index: WriteIndex, num_tokens: int, block_size: int) -> None:
    """Raise ``ValueError`` unless ``index`` was built for this many tokens and block size."""
    if not isinstance(index, WriteIndex):
        raise ValueError(f"index must be a WriteIndex, got {type(index).__name__}")
    if index.block_size != block_size:
        raise ValueError(f"index built for block_size {index.block_size}, cache has {block_size}")
    num_rows = index.blocks.shape[0] if index.keep is None else index.keep.shape[0]
    if num_rows != num_tokens:
        raise ValueError(f"index built for {num_rows} tokens, got {num_tokens}")


def check_decode_metadata(metadata: DecodeMetadata, batch: int, block_size: int) -> None:
    """Raise ``ValueError`` unless ``metadata`` was built for this batch and block size."""
    if not isinstance(metadata, DecodeMetadata):
        raise ValueError(f"metadata must be a DecodeMetadata, got {type(metadata).__name__}")
    if metadata.block_size != block_size or metadata.batch != batch:
        raise ValueError(
            f"metadata built for batch {metadata.batch} / block_size {metadata.block_size}, "
            f"got batch {batch} / block_size {block_size}"
        )
