"""Triton kernels vs the torch references, under Triton's CPU interpreter.

Not collected directly (the name does not match ``test_*.py``): the interpreter
must be switched on before ``triton`` is first imported, so
``test_triton_interpreted.py`` runs this file in a fresh ``pytest`` subprocess
with ``TRITON_INTERPRET=1``. To run it by hand:

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/triton_checks.py -q

Shapes are small because the interpreter executes each program in numpy.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import pytest
import torch
from kernel_cases import assert_close, extend_inputs, make_paged_case, slots_of

import kernels
from kernels.step.bind import StepDims, bind_step

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 (see the module docstring)")

DTYPES = [torch.float32, torch.bfloat16]
# (group, head_dim, block_size, lens, partition_size)
DECODE_CASES = [
    (1, 64, 8, [1, 8, 13], None),
    (3, 64, 16, [16, 5, 37], 16),  # 16 = exactly one block; split context
    (4, 128, 64, [64, 100], 32),
    (4, 64, 8, [70, 3], 16),  # many partitions, one sequence in the first only
    (3, 128, 16, [33], None),
]
# (group, head_dim, block_size, lens, q_lens)
EXTEND_CASES = [
    (1, 64, 8, [13, 8], [13, 8]),  # prefill, no cached prefix
    (3, 64, 16, [40, 16, 21], [7, 1, 21]),  # prefix + chunk, a decode-like row, none
    (4, 128, 64, [70, 64], [20, 0]),  # a sequence with no new tokens
    (3, 64, 8, [50], [35]),  # chunk spans several query tiles and blocks
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size", "lens", "partition"), DECODE_CASES)
def test_decode_triton_matches_reference(group, head_dim, block_size, lens, partition, dtype):
    case = make_paged_case(lens, block_size, 2, head_dim, dtype, extra_table_cols=2)
    query = torch.randn(len(lens), 2 * group, head_dim).to(dtype)
    args = (query, case.k_cache, case.v_cache, case.block_tables, case.context_lens)
    scale = 1 / math.sqrt(head_dim)
    ref = kernels.paged_decode_attention(*args, scale, backend="torch")
    # The flash-decoding kernel (partitions sized by the batch): the non-invariant mode.
    out = kernels.paged_decode_attention(
        *args, scale, backend="triton", partition_size=partition, invariant=False
    )
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size", "lens", "q_lens"), EXTEND_CASES)
def test_extend_triton_matches_reference(group, head_dim, block_size, lens, q_lens, dtype):
    """The extend kernel (``invariant=False``; the span kernel: triton_span_checks.py)."""
    case = make_paged_case(lens, block_size, 2, head_dim, dtype)
    query, starts = extend_inputs(case, q_lens, 2 * group)
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens)
    scale = 1 / math.sqrt(head_dim)
    ref = kernels.paged_extend_attention(*args, scale, backend="torch")
    out = kernels.paged_extend_attention(*args, scale, backend="triton", invariant=False)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_write_kv_triton_matches_reference(block_size, dtype):
    triton_case = make_paged_case([20, 9], block_size, 2, 64, dtype)
    torch_case = make_paged_case([20, 9], block_size, 2, 64, dtype)
    positions = torch.tensor([19, 0, 7])
    slots = torch.cat(
        [
            slots_of(triton_case, 0, positions),
            torch.tensor([-1]),
            slots_of(triton_case, 1, torch.tensor([8])),
        ]
    )
    key = torch.randn(5, 2, 64).to(dtype)
    value = torch.randn(5, 2, 64).to(dtype)
    kernels.write_kv(torch_case.k_cache, torch_case.v_cache, key, value, slots, backend="torch")
    kernels.write_kv(triton_case.k_cache, triton_case.v_cache, key, value, slots, backend="triton")
    assert torch.equal(triton_case.pool, torch_case.pool)


def test_copy_blocks_triton_matches_reference():
    case = make_paged_case([40], 8, 2, 64, spare_blocks=4)
    pairs = torch.tensor([[3, 6], [0, 7], [2, 8]])
    expected = case.pool.clone()
    kernels.copy_blocks(expected, expected, pairs, backend="torch")
    kernels.copy_blocks(case.pool, case.pool, pairs, backend="triton")
    assert torch.equal(case.pool, expected)
    other = torch.zeros_like(case.pool)
    kernels.copy_blocks(case.pool, other, pairs[:, [1, 0]], backend="triton")
    for src, dst in pairs[:, [1, 0]].tolist():
        assert torch.equal(other[dst], case.pool[src])
    assert not other[[1, 4, 5]].any()


def test_strided_inputs_as_the_engine_passes_them():
    """q, k, v are column slices of one fused QKV projection: rows are strided."""
    case = make_paged_case([12, 30], 8, 2, 64)
    num_tokens = 5
    qkv = torch.randn(num_tokens, 4 + 2 + 2, 64)
    query, key, value = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    slots = torch.cat(
        [slots_of(case, 0, torch.tensor([11])), slots_of(case, 1, torch.arange(26, 30))]
    )
    expected = case.pool.clone()
    k_ref, v_ref = expected[:, 1, 0], expected[:, 1, 1]
    kernels.write_kv(k_ref, v_ref, key, value, slots, backend="torch")
    kernels.write_kv(case.k_cache, case.v_cache, key, value, slots, backend="triton")
    assert torch.equal(case.pool, expected)

    starts = torch.tensor([0, 1, 5], dtype=torch.int32)
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, 0.125)
    ref = kernels.paged_extend_attention(*args, backend="torch")
    assert_close(kernels.paged_extend_attention(*args, backend="triton"), ref, torch.float32)

    decode_query = qkv[:2, :4]
    args = (decode_query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125)
    ref = kernels.paged_decode_attention(*args, backend="torch")
    out = kernels.paged_decode_attention(
        *args, backend="triton", partition_size=16, invariant=False
    )
    assert_close(out, ref, torch.float32)
    assert_close(kernels.paged_decode_attention(*args, backend="triton"), ref, torch.float32)


class _Batch(NamedTuple):
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    is_decode: bool
    max_query_len: int


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 9, 3]])
def test_a_step_bound_to_triton_matches_the_torch_step(q_lens, dtype):
    """bind_step's Triton step (the decode kernel for a decode step, else extend) writes
    and attends as the torch step does, in both layers of the pool."""
    lens = [37, 20, 9]
    case = make_paged_case(lens, 8, 2, 64, dtype)
    slots = torch.cat(
        [
            slots_of(case, b, torch.arange(n - q, n))
            for b, (n, q) in enumerate(zip(lens, q_lens, strict=True))
        ]
    )
    starts = torch.zeros(len(lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    batch = _Batch(
        slots, case.block_tables, starts, case.context_lens, max(q_lens) == 1, max(q_lens)
    )
    dims = StepDims(num_q_heads=6, scale=0.125, eps=1e-5)
    torch_pool = case.pool.clone()
    on_triton = bind_step(batch, case.pool, dims, backend="triton")
    on_torch = bind_step(batch, torch_pool, dims, backend="torch")
    assert on_triton.backend == "triton" and on_torch.backend == "torch"
    tokens = sum(q_lens)
    qkv = torch.randn(tokens, 6 + 2 + 2, 64).to(dtype)
    q, k, v = qkv[:, :6], qkv[:, 6:8], qkv[:, 8:]
    for layer in (0, 1):
        on_triton.write_kv(layer, k, v)
        on_torch.write_kv(layer, k, v)
        assert torch.equal(case.pool, torch_pool)
        assert_close(on_triton.attention(layer, q), on_torch.attention(layer, q), dtype)
