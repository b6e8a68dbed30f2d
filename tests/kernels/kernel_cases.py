"""Builders shared by the kernel tests: paged KV with shuffled blocks, and a dense oracle.

``PagedCase`` holds one layer of a real pool (``kv_layout.new_kv_pool`` with two
layers, so the layer views are strided like the engine's) filled with random
K/V for ragged sequences whose blocks are a random permutation of the pool:
non-contiguous and out of order. The dense per-sequence K/V stay alongside, so
the oracle can attend over contiguous tensors with an explicit causal mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.kv_layout import KVShape, layer_views, new_kv_pool

# Tolerances per dtype, for every comparison in this package (atol, rtol).
# fp32: both sides accumulate in fp32 (or better); differences are rounding
# order only. bf16: inputs/outputs carry 8 mantissa bits (eps 7.8e-3) and the
# softmax weights are rounded to bf16 before the PV product on the Triton side.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (2.5e-2, 2.5e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@dataclass
class PagedCase:
    pool: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with -1
    context_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence [len, H_kv, D], dense
    values: list[torch.Tensor]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]


def make_paged_case(
    lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    extra_table_cols: int = 1,
) -> PagedCase:
    """Random K/V for sequences of ``lens`` tokens, stored through shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = KVShape(2, block_size, num_kv_heads, head_dim)
    pool = new_kv_pool(num_blocks, shape, dtype, "cpu")
    pool.copy_(torch.randn(pool.shape, generator=gen).to(dtype))  # garbage outside contexts
    k_cache, v_cache = layer_views(pool, 1)
    order = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq) + extra_table_cols
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    keys, values = [], []
    used = 0
    for b, (n, nb) in enumerate(zip(lens, blocks_per_seq, strict=True)):
        tables[b, :nb] = order[used : used + nb].int()
        used += nb
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(n)
        blocks = tables[b, pos // block_size].long()
        k_cache[blocks, pos % block_size] = k
        v_cache[blocks, pos % block_size] = v
        keys.append(k)
        values.append(v)
    return PagedCase(
        pool, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), keys, values
    )


def share_prefix(case: PagedCase, leader: int, member: int, num_blocks: int) -> None:
    """Map ``member``'s first ``num_blocks`` blocks onto ``leader``'s, as the prefix cache
    maps a shared system prompt; its dense K/V follow. Both must be that long."""
    n = num_blocks * case.block_size
    case.block_tables[member, :num_blocks] = case.block_tables[leader, :num_blocks]
    case.keys[member][:n] = case.keys[leader][:n]
    case.values[member][:n] = case.values[leader][:n]


def slots_of(case: PagedCase, b: int, positions: torch.Tensor) -> torch.Tensor:
    """Slots of sequence ``b``'s token ``positions`` (int64)."""
    bs = case.block_size
    return case.block_tables[b, positions // bs].long() * bs + positions % bs


def dense_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_pos: torch.Tensor
) -> torch.Tensor:
    """Naive oracle in float64: ``query [n, H_q, D]`` at ``query_pos [n]`` over contiguous
    ``keys/values [len, H_kv, D]`` with a causal mask; returns ``[n, H_q, D]`` float64."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", query.double(), k) / math.sqrt(query.shape[-1])
    visible = torch.arange(keys.shape[0])[None, :] <= query_pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def decode_oracle(case: PagedCase, query: torch.Tensor) -> torch.Tensor:
    outs = [
        dense_attention(query[b : b + 1], k, v, torch.tensor([k.shape[0] - 1]))[0]
        for b, (k, v) in enumerate(zip(case.keys, case.values, strict=True))
    ]
    return torch.stack(outs)


def extend_inputs(
    case: PagedCase, q_lens: list[int], num_q_heads: int, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query [T, H_q, D], query_start_loc [B + 1])`` for the last ``q_lens`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    head_dim = case.k_cache.shape[3]
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(case.pool.dtype)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return query, starts


def extend_oracle(case: PagedCase, query: torch.Tensor, q_lens: list[int]) -> torch.Tensor:
    outs, start = [], 0
    for k, v, q_len in zip(case.keys, case.values, q_lens, strict=True):
        positions = torch.arange(k.shape[0] - q_len, k.shape[0])
        outs.append(dense_attention(query[start : start + q_len], k, v, positions))
        start += q_len
    return torch.cat(outs)
