"""One layer's paged-attention inputs as one value, passed from the public functions to
the checks and to each backend's launcher.

    query            [T, H_q, D]                the new tokens of B sequences, flat
    k_cache, v_cache [N, block_size, H_kv, D]   one layer's views of the pool
    block_tables     [B, max_blocks] int32
    query_start_loc  [B + 1] int32              sequence b owns query rows
                                                [start[b], start[b + 1]);
                     None for a decode          one new token per sequence, T = B
    context_lens     [B] int32                  each sequence's tokens, new ones included
    scale            the softmax scale

On the CPU one kernel per backend serves decodes and extends alike (a decode is the
run of one new token), so the CPU paths take a decode's inputs ``one_token_each()``;
Triton has a decode kernel of its own that reads no start tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class AttentionInputs(NamedTuple):
    """See the module docstring."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor | None
    context_lens: torch.Tensor
    scale: float

    def one_token_each(self) -> AttentionInputs:
        """A decode's inputs with the start tensor ``0, 1, ..., B`` the CPU kernels read."""
        if self.query_start_loc is not None:
            return self
        batch = self.query.shape[0]
        starts = torch.arange(batch + 1, dtype=torch.int32, device=self.query.device)
        return self._replace(query_start_loc=starts)
