"""Builders shared by the kernel tests: paged KV with shuffled blocks, and a dense oracle.

``PagedCase`` holds one layer of a real pool (``kv_layout.new_kv_pool`` with two
layers, so the layer views are strided like the engine's) filled with random
K/V for ragged sequences whose blocks are a random permutation of the pool:
non-contiguous and out of order. The dense per-sequence K/V stay alongside, so
the oracle can attend over contiguous tensors with an explicit causal mask.

An int8 case (``kv_dtype=torch.int8``) writes its K/V through the reference quantizer
(``kernels.kv_quant``) and keeps both what was written (``raw_keys``) and what the cache
now holds, dequantized exactly (``keys``): the oracle of the kernels is then the
dense attention over the dequantized K/V, at the query dtype's tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.kv_layout import KVScales, KVShape, is_quantized, layer_kv, new_kv_pool
from kernels.kv_quant import dequantize_rows, quantize_rows

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
    keys: list[torch.Tensor]  # per sequence [len, H_kv, D], dense (as the cache holds them,
    # in the queries' dtype; int8: dequantized, in fp32, which holds every q * scale exactly)
    values: list[torch.Tensor]
    scales: KVScales | None = None  # an int8 cache's
    raw_keys: list[torch.Tensor] | None = None  # an int8 case's K/V before quantization
    raw_values: list[torch.Tensor] | None = None

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The queries' and outputs' dtype (the pool's, or the one quantized into int8)."""
        return (self.raw_keys or self.keys)[0].dtype


def make_paged_case(
    lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    extra_table_cols: int = 1,
    kv_dtype: torch.dtype | None = None,
) -> PagedCase:
    """Random K/V for sequences of ``lens`` tokens, stored through shuffled block tables
    (``dtype``: the values'; ``kv_dtype``: the pool's, None for ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = KVShape(2, block_size, num_kv_heads, head_dim)
    pool = new_kv_pool(num_blocks, shape, kv_dtype or dtype, "cpu")
    quantized = is_quantized(pool.dtype)
    if quantized:  # garbage outside contexts: random bytes, NaN scales among them
        pool.copy_(torch.randint(-128, 128, pool.shape, generator=gen, dtype=torch.int8))
    else:
        pool.copy_(torch.randn(pool.shape, generator=gen).to(dtype))
    k_cache, v_cache, scales = layer_kv(pool, 1)
    raw_keys, raw_values = [], []
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
        if quantized:
            raw_keys.append(k)
            raw_values.append(v)
            (qk, sk), (qv, sv) = quantize_rows(k), quantize_rows(v)
            k_cache[blocks, pos % block_size], scales.k[blocks, pos % block_size] = qk, sk
            v_cache[blocks, pos % block_size], scales.v[blocks, pos % block_size] = qv, sv
            k, v = dequantize_rows(qk, sk), dequantize_rows(qv, sv)  # fp32: exact
        else:
            k_cache[blocks, pos % block_size] = k.to(pool.dtype)
            v_cache[blocks, pos % block_size] = v.to(pool.dtype)
            # A bf16 pool under fp32 queries: what it holds, widened back (else a no-op).
            k, v = k.to(pool.dtype).to(dtype), v.to(pool.dtype).to(dtype)
        keys.append(k)
        values.append(v)
    lens_tensor = torch.tensor(lens, dtype=torch.int32)
    if not quantized:
        return PagedCase(pool, k_cache, v_cache, tables, lens_tensor, keys, values)
    return PagedCase(
        pool, k_cache, v_cache, tables, lens_tensor, keys, values, scales, raw_keys, raw_values
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
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(case.dtype)
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
