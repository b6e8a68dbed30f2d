"""Gather helpers of the torch references: token positions -> (block, offset).

Index diagram for one sequence (block_size 4, table [7, 2, 9]):

    position   0 1 2 3 | 4 5 6 7 | 8 9
    block      7 7 7 7 | 2 2 2 2 | 9 9
    offset     0 1 2 3 | 0 1 2 3 | 0 1

``k_cache[blocks, offsets]`` then reads a sequence's K in position order
straight from the strided layer view, without copying the whole layer.
"""

from __future__ import annotations

import torch


def batch_gather_index(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded ``(blocks [B, T], offsets [T], valid [B, T])`` with ``T = max(context_lens)``.

    Positions past a sequence's length read block 0 (always inside the pool)
    and are masked out through ``valid``.
    """
    max_len = int(context_lens.max())
    positions = torch.arange(max_len, device=block_tables.device)
    valid = positions[None, :] < context_lens.long()[:, None]
    columns = (positions // block_size).expand(block_tables.shape[0], -1)
    blocks = block_tables.long().gather(1, columns)
    blocks = torch.where(valid, blocks, torch.zeros_like(blocks))
    return blocks, positions % block_size, valid


def sequence_gather_index(
    block_table: torch.Tensor, context_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks [T], offsets [T])`` of one sequence's first ``context_len`` tokens."""
    positions = torch.arange(context_len, device=block_table.device)
    return block_table.long()[positions // block_size], positions % block_size
