"""Gather helpers of the torch references: a sequence's K/V in position order.

Index diagram for one sequence (block_size 4, table [7, 2, 9], 10 tokens):

    position   0 1 2 3 | 4 5 6 7 | 8 9 . .
    block      7 7 7 7 | 2 2 2 2 | 9 9 9 9   <- the last block is partly filled

``cache[ids]`` copies whole blocks (one contiguous ``[block_size, H_kv, D]``
chunk each in a layer view), which is much cheaper than a per-token gather;
positions past the context length are masked by the caller.
"""

from __future__ import annotations

import torch


def batch_block_ids(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, int]:
    """``(ids [B, n], n * block_size)`` with ``n`` the blocks of the longest context.

    Table entries past a sequence's last block are padding (possibly -1): they
    are replaced by block 0, always inside the pool, and masked by the caller.
    """
    lens = context_lens.long()
    num_cols = -(-int(lens.max()) // block_size)
    used = (lens + block_size - 1) // block_size
    ids = block_tables[:, :num_cols].long()
    column = torch.arange(num_cols, device=ids.device)
    ids = torch.where(column[None, :] < used[:, None], ids, torch.zeros_like(ids))
    return ids, num_cols * block_size


def gather_tokens(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``cache[ids]`` with (block, offset) merged: ``[*ids.shape[:-1], n * bs, H_kv, D]``."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    chunk = block_size * num_kv_heads * head_dim
    if cache.stride()[1:] == (num_kv_heads * head_dim, head_dim, 1):
        # Each block of a layer view is one contiguous row: index_select on
        # rows copies whole chunks, about twice as fast as 4-D indexing.
        rows = torch.as_strided(cache, (num_blocks, chunk), (cache.stride(0), 1))
        blocks = torch.index_select(rows, 0, ids.reshape(-1))
    else:
        blocks = cache[ids.reshape(-1)]
    return blocks.view(*ids.shape[:-1], ids.shape[-1] * block_size, num_kv_heads, head_dim)


def masked_scores_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive SDPA mask: 0 where ``allowed``, -inf elsewhere.

    An additive float mask keeps torch's fused CPU attention kernel in play,
    where a boolean mask often falls back to the unfused path.
    """
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, float("-inf"))
