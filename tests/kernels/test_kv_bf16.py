"""bf16 KV under an fp32 model (``CHATSVC_KV_DTYPE=bf16``, kernels/kv_layout.py): the KV
write rounds each value as torch's ``.to(torch.bfloat16)`` does on every CPU backend, and
the attention over such a cache reads what it holds, widened: bit for bit what it gives
over an fp32 cache of the same values, and alone what it gives in a batch."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import assert_close, extend_inputs, extend_oracle, make_paged_case

import kernels
from kernels.kv_layout import KVShape, holds, is_narrowed, kv_dtype_for, layer_kv, new_kv_pool


def rows_with_edge_values(tokens: int, heads: int, head_dim: int) -> torch.Tensor:
    """fp32 rows holding values that round every way: ties to even (both directions),
    just past a tie, the largest finite values, infinities, NaN and signed zeros."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(tokens, heads, head_dim, generator=gen) * 3
    edges = torch.tensor(
        [0x3F808000, 0x3F818000, 0x3F808001, 0xBF808000, 0x7F7FFFFF, 0x7F800000,
         0xFF800000, 0x7FC00000, 0x80000000, 0x00000001],
        dtype=torch.int64,
    ).to(torch.int32).view(torch.float32)  # fmt: skip
    rows[0, 0, : len(edges)] = edges
    return rows


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # NaN == NaN here: the rows hold one, and any NaN must stay NaN.
    nan = torch.isnan(a.float())
    return bool(torch.equal(nan, torch.isnan(b.float())) and torch.equal(a[~nan], b[~nan]))


def test_the_names_and_the_pairs_a_pool_holds():
    assert kv_dtype_for("bf16", torch.float32) == torch.bfloat16
    assert kv_dtype_for("bf16", torch.bfloat16) == torch.bfloat16  # the model's own: "auto"
    with pytest.raises(ValueError, match="fp32 or bf16 model"):
        kv_dtype_for("bf16", torch.float16)
    assert holds(torch.bfloat16, torch.float32) and not holds(torch.float32, torch.bfloat16)
    assert is_narrowed(torch.bfloat16, torch.float32)
    assert not is_narrowed(torch.bfloat16, torch.bfloat16)
    # A bf16 block is half an fp32 one: twice the blocks in the same bytes.
    shape = KVShape(30, 16, 3, 64)
    assert 2 * shape.block_bytes(torch.bfloat16) == shape.block_bytes(torch.float32)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_fp32_rows_are_rounded_into_a_bf16_cache_as_torch_rounds(backend):
    shape = KVShape(2, 8, 3, 64)
    key = rows_with_edge_values(20, 3, 64)
    value = -key.flip(0)
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(40, generator=gen)[:20]
    slots[4] = -1
    pool = new_kv_pool(5, shape, torch.bfloat16, "cpu")
    k, v, _ = layer_kv(pool, 1)
    kernels.write_kv(k, v, key, value, slots, backend=backend)
    kept = slots >= 0
    assert same_bits(k.flatten(0, 1)[slots[kept]], key[kept].to(torch.bfloat16))
    assert same_bits(v.flatten(0, 1)[slots[kept]], value[kept].to(torch.bfloat16))
    assert not layer_kv(pool, 0).k.any()  # other layers untouched
    written = torch.zeros(40, dtype=torch.bool)
    written[slots[kept]] = True
    assert not k.flatten(0, 1)[~written].any()  # nor other slots


def test_a_bf16_cache_refuses_rows_it_cannot_hold():
    pool = new_kv_pool(2, KVShape(1, 8, 2, 64), torch.bfloat16, "cpu")
    k, v, _ = layer_kv(pool, 0)
    rows = torch.randn(1, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="does not hold key"):
        kernels.write_kv(k, v, rows, rows, torch.tensor([3]))
    fp32_pool = new_kv_pool(2, KVShape(1, 8, 2, 64), torch.float32, "cpu")
    k, v, _ = layer_kv(fp32_pool, 0)
    query = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="does not hold query"):
        kernels.paged_decode_attention(query, k, v, tables, lens, 0.125)


CASES = [
    ([1, 40, 300], [1, 6, 2], 8),  # decodes and short runs
    ([1600], [3], 16),  # one long sequence: spans and their merge
    ([290, 45], [40, 45], 32),  # prefill chunks past the C loops' query tile
]


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize(("lens", "q_lens", "block_size"), CASES)
def test_attention_over_bf16_kv_is_attention_over_its_values(
    lens, q_lens, block_size, backend, invariant
):
    """fp32 queries over a bf16 cache: the oracle's values within fp32's tolerance, and
    with the invariant kernels the same bits as over an fp32 cache of the same values."""
    case = make_paged_case(lens, block_size, 2, 64, torch.float32, kv_dtype=torch.bfloat16)
    query, starts = extend_inputs(case, q_lens, 6)
    scale = 1 / math.sqrt(64)
    tables, context = case.block_tables, case.context_lens
    out = kernels.paged_extend_attention(
        query, case.k_cache, case.v_cache, tables, starts, context, scale,
        backend=backend, invariant=invariant,
    )  # fmt: skip
    assert out.dtype == torch.float32
    assert_close(out, extend_oracle(case, query, q_lens), torch.float32)
    if invariant:  # else long runs over fp32 take the SDPA groups, over bf16 the spans
        widened = kernels.paged_extend_attention(
            query, case.k_cache.float(), case.v_cache.float(), tables, starts, context, scale,
            backend=backend, invariant=invariant,
        )  # fmt: skip
        assert torch.equal(out, widened)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_a_decode_over_bf16_kv_is_bit_identical_alone_and_in_a_batch(backend):
    case = make_paged_case([300, 77, 520], 16, 3, 64, torch.float32, kv_dtype=torch.bfloat16)
    query, _ = extend_inputs(case, [1, 1, 1], 9)
    caches = (case.k_cache, case.v_cache)
    batched = kernels.paged_decode_attention(
        query, *caches, case.block_tables, case.context_lens, 0.125, backend=backend
    )
    for b in range(3):
        alone = kernels.paged_decode_attention(
            query[b : b + 1],
            *caches,
            case.block_tables[b : b + 1],
            case.context_lens[b : b + 1],
            0.125,
            backend=backend,
        )
        assert torch.equal(alone[0], batched[b])
