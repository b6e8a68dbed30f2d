"""int8 KV (kernels/kv_layout.py, kernels/kv_quant.py): the layout, the quantizer and its
error bound, the KV write on every CPU backend bit for bit, and the native attention
against the float64 oracle (over the dequantized K/V at the query dtype's tolerance, and
over the K/V before quantization within the quantization's)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from kernel_cases import (
    PagedCase,
    assert_close,
    extend_inputs,
    extend_oracle,
    make_paged_case,
    slots_of,
)

import kernels
from kernels.attention_inputs import AttentionInputs
from kernels.cpu.attention import paged_attention_native
from kernels.kv_layout import (
    BLOCK_ALIGN_BYTES,
    HUGE_PAGE_BYTES,
    KVShape,
    layer_kv,
    new_kv_pool,
    num_layers,
    scale_views,
)
from kernels.kv_quant import dequantize_rows, quantize_rows
from tests.memory_maps import vm_flags

# Attention over int8 K/V against attention over the K/V before quantization: each
# value is off by at most half its row's step (max|x| / 254), which moves a score by
# at most that times the query's L1 norm, and an output by at most its V rows' step.
QUANT_TOLERANCE = (4e-2, 4e-2)


def test_a_smollm2_block_holds_its_scales_and_keeps_the_alignment():
    shape = KVShape(30, 16, 3, 64)
    int8, bf16 = shape.block_bytes(torch.int8), shape.block_bytes(torch.bfloat16)
    assert int8 % BLOCK_ALIGN_BYTES == 0
    assert bf16 / int8 >= 1.9  # the tokens per pool byte
    pool = new_kv_pool(3, shape, torch.int8, "cpu")
    assert pool.shape == (3, 31, 2, 16, 3, 64) and num_layers(pool) == 30
    for layers, head_dim in ((1, 16), (30, 64), (32, 64), (33, 64), (80, 128), (7, 16)):
        pool = new_kv_pool(1, KVShape(layers, 4, 2, head_dim), torch.int8, "cpu")
        assert num_layers(pool) == layers


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32])
def test_a_large_cpu_pool_lies_on_huge_pages_zeroed(dtype):
    shape = KVShape(30, 16, 3, 64)
    num_blocks = -(-5 * HUGE_PAGE_BYTES // shape.block_bytes(dtype))  # over 4 MiB: advised
    pool = new_kv_pool(num_blocks, shape, dtype, "cpu")
    assert pool.shape == (num_blocks, shape.pool_layers(dtype), 2, 16, 3, 64)
    assert pool.is_contiguous() and pool.dtype == dtype
    assert pool.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not pool.view(torch.uint8).any()
    if Path("/sys/kernel/mm/transparent_hugepage").is_dir():  # a kernel with THP
        assert "hg" in vm_flags(pool.data_ptr())  # MADV_HUGEPAGE marks the mapping
    small = new_kv_pool(2, KVShape(2, 4, 2, 16), dtype, "cpu")  # tests' pools: plain zeros
    assert not small.any()


def test_scales_lie_inside_their_block_and_move_with_it():
    shape = KVShape(5, 4, 2, 16)
    pool = new_kv_pool(4, shape, torch.int8, "cpu")
    block_bytes = shape.block_bytes(torch.int8)
    seen = set()
    for layer in range(5):
        for scale in scale_views(pool, layer):
            scale[2].fill_(1.5)  # block 2 only
            start = scale[2].data_ptr() - pool.data_ptr()
            assert 2 * block_bytes <= start < 3 * block_bytes
            seen.add(start)
    assert len(seen) == 10  # every layer's K and V scales apart
    kernels.copy_blocks(pool, pool, torch.tensor([[2, 0]]), backend="torch")
    for layer in range(5):
        assert all(bool((scale[0] == 1.5).all()) for scale in scale_views(pool, layer))


def test_the_quantizer_bounds_each_values_error_by_half_a_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 64, generator=gen) * torch.logspace(-6, 4, 64)[:, None, None]
    x[5, 1] = 0.0
    x[6, 0, 7] = 1e3  # an outlier channel: its row's step grows, nothing clips
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16
    assert int(q.abs().max()) <= 127
    amax = x.abs().amax(-1)
    s = scale.float()
    assert bool((s >= amax / 127).all()) and bool((s <= amax / 127 * (1 + 2**-7)).all())
    assert bool(((q.float().abs().amax(-1) >= 126) | (amax == 0)).all())
    error = (dequantize_rows(q, scale, torch.float64) - x.double()).abs()
    assert bool((error <= s.double().unsqueeze(-1) / 2).all())
    assert float(scale[5, 1]) == 0.0 and not q[5, 1].any()
    x[9, 2, 3] = float("nan")
    q, scale = quantize_rows(x)
    assert math.isnan(float(scale[9, 2])) and not q[9, 2].any()  # NaN stays visible


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_cpu_backend_writes_the_same_bits_one_token_at_a_time_or_all_at_once(dtype):
    gen = torch.Generator().manual_seed(1)
    shape = KVShape(2, 8, 3, 64)
    key = (torch.randn(20, 3, 64, generator=gen) * 3).to(dtype)
    value = torch.randn(20, 3, 64, generator=gen).to(dtype)
    slots = torch.randperm(40, generator=gen)[:20]
    slots[4] = -1
    pools = {}
    for backend in ("torch", "native"):
        pool = new_kv_pool(5, shape, torch.int8, "cpu")
        k, v, scales = layer_kv(pool, 1)
        kernels.write_kv(k, v, key, value, slots, backend=backend, scales=scales)
        pools[backend] = pool
    one_by_one = new_kv_pool(5, shape, torch.int8, "cpu")
    k, v, scales = layer_kv(one_by_one, 1)
    for t in reversed(range(20)):
        row = slice(t, t + 1)
        kernels.write_kv(k, v, key[row], value[row], slots[row], backend="native", scales=scales)
    assert torch.equal(pools["torch"], pools["native"])
    assert torch.equal(pools["torch"], one_by_one)
    assert not layer_kv(pools["torch"], 0).k.any()  # other layers untouched
    k, _, scales = layer_kv(pools["native"], 1)
    written = slots[slots >= 0]
    got = dequantize_rows(k.flatten(0, 1)[written], scales.k.flatten(0, 1)[written])
    q, s = quantize_rows(key[slots >= 0])
    assert torch.equal(got, dequantize_rows(q, s))


def _int8_inputs(case: PagedCase, query, starts):
    scale = 1 / math.sqrt(query.shape[-1])
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens)
    return args, scale


def _raw(case: PagedCase) -> PagedCase:
    return PagedCase(
        case.pool,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.context_lens,
        case.raw_keys,
        case.raw_values,
    )


def check_int8(
    lens, q_lens, block_size, num_kv_heads, group, head_dim, dtype, lib=None, backend="native"
):
    """The attention over an int8 case (the native kernel, another build's ``lib``, or the
    torch reference) against the oracle: over the dequantized K/V at the query dtype's
    tolerance, over the K/V before quantization at the quantization's."""
    case = make_paged_case(lens, block_size, num_kv_heads, head_dim, dtype, kv_dtype=torch.int8)
    query, starts = extend_inputs(case, q_lens, num_kv_heads * group)
    if lib is None:
        args, scale = _int8_inputs(case, query, starts)
        out = kernels.paged_extend_attention(*args, scale, backend=backend, scales=case.scales)
    else:  # another build's library
        out = torch.full_like(query, float("nan"))
        args, scale = _int8_inputs(case, query, starts)
        seqs = torch.arange(len(lens), dtype=torch.int32)
        paged_attention_native(
            AttentionInputs(*args, scale), seqs, out, lib=lib, scales=case.scales
        )
    assert_close(out, extend_oracle(case, query, q_lens), dtype)
    atol, rtol = QUANT_TOLERANCE
    expected = extend_oracle(_raw(case), query, q_lens)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "lens, q_lens, block_size",
    [
        ([1, 40, 300], [1, 6, 2], 8),  # decodes and short runs, one sequence of one token
        ([37, 5, 70], [1, 5, 2], 4),  # key tiles across small blocks
        ([1600], [3], 16),  # one long sequence: spans and their merge
        ([290, 45], [40, 45], 32),  # prefill chunks past the vector loops' query tile
    ],
)
def test_native_attention_over_int8_kv_matches_the_oracle(lens, q_lens, block_size, dtype):
    check_int8(lens, q_lens, block_size, 2, 3, 64, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_reference_over_int8_kv_matches_the_oracle(dtype):
    check_int8([1, 40, 300], [1, 6, 2], 8, 2, 3, 64, dtype, backend="torch")
    check_int8([290, 45], [40, 45], 32, 2, 3, 64, dtype, backend="torch")


@pytest.mark.parametrize("num_kv_heads", [1, 4, 5])
@pytest.mark.parametrize("block_size", [16, 32])
def test_scales_of_any_head_count_reach_the_byte_dots(num_kv_heads, block_size):
    # Up to 4 KV heads a block's 16 slots of scales are read by a word permute, beyond by
    # a gather: each head must get its own scales either way.
    check_int8([40, 77, 9], [1, 3, 9], block_size, num_kv_heads, 2, 64, torch.bfloat16)


@pytest.mark.parametrize("head_dim", [32, 96, 128, 256])
def test_head_sizes_other_than_64(head_dim):
    # bf16 queries take the byte dots, whose V quads work in 64 dims (32 and 96: a tail;
    # 256: the largest, one row's P.V sums filling the registers).
    check_int8([23, 40], [1, 4], 8, 2, 2, head_dim, torch.bfloat16)


@pytest.mark.parametrize("head_dim, group", [(32, 3), (64, 8)])
def test_more_rows_of_a_kv_head_than_one_pass_of_key_scores_holds(head_dim, group):
    # The byte dots score a KV head's rows in passes of head_dim / 2 rows: six new tokens
    # of 3 or 8 query heads per KV head take two passes, one token's rows cut between them.
    check_int8([23, 40], [6, 6], 8, 2, group, head_dim, torch.bfloat16)


def test_a_small_head_size_on_the_widening_loops():
    check_int8([23, 40], [1, 4], 8, 2, 2, 16, torch.float32)


def test_a_decode_over_int8_kv_is_bit_identical_alone_and_in_a_batch():
    case = make_paged_case([300, 77, 520], 16, 3, 64, torch.bfloat16, kv_dtype=torch.int8)
    query, _ = extend_inputs(case, [1, 1, 1], 9)
    args = (query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    batched = kernels.paged_decode_attention(*args, scales=case.scales)
    for b in range(3):
        alone = kernels.paged_decode_attention(
            query[b : b + 1],
            case.k_cache,
            case.v_cache,
            case.block_tables[b : b + 1],
            case.context_lens[b : b + 1],
            0.125,
            scales=case.scales,
        )
        assert torch.equal(alone[0], batched[b])


def test_int8_kv_is_refused_without_its_scales_or_where_no_kernel_reads_it():
    case = make_paged_case([30], 8, 2, 64, kv_dtype=torch.int8)
    query, starts = extend_inputs(case, [2], 6)
    args, scale = _int8_inputs(case, query, starts)
    with pytest.raises(ValueError, match="needs its scales"):
        kernels.paged_extend_attention(*args, scale, backend="native")
    with pytest.raises(ValueError, match="invariant kernels only"):
        kernels.paged_extend_attention(
            *args, scale, backend="triton", scales=case.scales, invariant=False
        )
    floats = make_paged_case([30], 8, 2, 64)
    key = torch.randn(1, 2, 64)
    slot = slots_of(floats, 0, torch.tensor([3]))
    with pytest.raises(ValueError, match="takes no scales"):
        kernels.write_kv(floats.k_cache, floats.v_cache, key, key, slot, scales=case.scales)
    with pytest.raises(ValueError, match="k_scale must be"):
        wrong = type(case.scales)(case.scales.k.float(), case.scales.v.float())
        kernels.write_kv(case.k_cache, case.v_cache, key, key, slot, scales=wrong)
