"""The invariant Triton kernels under the interpreter: span attention (with its merge), the
matmul and RMSNorm. Right against their torch twins, and a row's bits independent of the
rows beside it, the chunking and the batch.

Run by ``test_triton_interpreted.py`` in its ``TRITON_INTERPRET=1`` subprocess (see
``triton_checks.py``); by hand:

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/triton_span_checks.py -q

The span is monkeypatched to 16 keys (``kernels.invariance.SPAN_TOKENS``, read at call
time; a multiple of the interpreted key tile, 16) so that contexts of a few dozen tokens
cross span boundaries. Under the interpreter ``tl.dot`` is numpy's matmul; on a GPU the
same property rests on the fixed program shapes (docs/kernels.md, "Invariance").
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from invariance_cases import Piece, attend_pieces, mismatches, random_schedule
from kernel_cases import assert_close, extend_inputs, make_paged_case

import kernels
from kernels import invariance
from kernels.matmul import matmul, matmul_torch
from kernels.rms_norm import rms_norm_torch, rms_norm_triton
from kernels.span_merge import merge_spans, merge_spans_torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 (see the module docstring)")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def small_span(monkeypatch):
    monkeypatch.setattr(invariance, "SPAN_TOKENS", 16)


def _attend(backend, scale=0.2):
    def attend(query, k_cache, v_cache, tables, starts, lens):
        args = (query, k_cache, v_cache, tables, starts, lens, scale)
        return kernels.paged_extend_attention(*args, backend=backend)

    return attend


@pytest.mark.parametrize(
    ("group", "dtype"), [(1, torch.float32), (3, torch.bfloat16), (4, torch.float32)]
)
def test_span_kernel_matches_the_torch_spans(small_span, group, dtype):
    """A chunk over a cached prefix, a prompt and decodes, 1-3 spans each."""
    lens, q_lens = [40, 21, 17, 5], [12, 21, 1, 1]
    case = make_paged_case(lens, 8, 2, 32, dtype)
    query, starts = extend_inputs(case, q_lens, 2 * group)
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, 0.2)
    out = kernels.paged_extend_attention(*args, backend="triton")
    assert out.dtype == dtype
    assert_close(out, kernels.paged_extend_attention(*args, backend="torch"), dtype)


def test_a_decode_is_the_extend_kernel_with_one_token_each(small_span):
    case = make_paged_case([40, 9, 33], 8, 2, 32, torch.bfloat16)
    query = torch.randn(3, 6, 32).to(torch.bfloat16)
    starts = torch.arange(4, dtype=torch.int32)
    tables, lens = case.block_tables, case.context_lens
    decode = kernels.paged_decode_attention(
        query, case.k_cache, case.v_cache, tables, lens, 0.2, backend="triton"
    )
    extend = kernels.paged_extend_attention(
        query, case.k_cache, case.v_cache, tables, starts, lens, 0.2, backend="triton"
    )
    assert torch.equal(decode, extend)
    with pytest.raises(ValueError, match="partition_size"):
        kernels.paged_decode_attention(
            query,
            case.k_cache,
            case.v_cache,
            tables,
            lens,
            0.2,
            backend="triton",
            partition_size=16,
        )


@settings(max_examples=4, deadline=None)
@given(
    lens=st.lists(st.integers(2, 40), min_size=2, max_size=2),
    group=st.sampled_from([1, 3]),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_rows_bits_do_not_depend_on_its_step(lens, group, bf16, seed):
    """Hypothesis (few examples: the interpreter is slow): random chunkings, decodes,
    companions and orders give each row the bits of its sequence attended alone."""
    saved = invariance.SPAN_TOKENS
    invariance.SPAN_TOKENS = 16
    try:
        dtype = torch.bfloat16 if bf16 else torch.float32
        case = make_paged_case(lens, 8, 2, 32, dtype, seed)
        gen = torch.Generator().manual_seed(seed)
        queries = [torch.randn(n, 2 * group, 32, generator=gen).to(dtype) for n in lens]
        steps = random_schedule(random.Random(seed), lens, max_cuts=2)
        assert mismatches(_attend("triton"), case, queries, steps) == []
    finally:
        invariance.SPAN_TOKENS = saved


def test_a_long_tile_past_the_row_changes_nothing(small_span):
    """One row at 21 alone, and in a 16-row tile whose last row is at 26: the tile reads key
    tiles the row does not see (all masked for it), which must leave its bits alone."""
    case = make_paged_case([27], 8, 2, 32)
    queries = [torch.randn(27, 6, 32)]
    (alone,) = attend_pieces(_attend("triton"), case, queries, [Piece(0, 21, 22)])
    (tile,) = attend_pieces(_attend("triton"), case, queries, [Piece(0, 16, 27)])
    assert torch.equal(alone, tile[5:6])


def test_the_merge_matches_its_twin():
    """Two new tokens at 39 and 40 (span 16: 3 spans each) of a table 4 spans wide."""
    gen = torch.Generator().manual_seed(0)
    part_acc = torch.randn(2, 4, 3, 32, generator=gen)
    part_ml = torch.stack(
        [torch.randn(2, 4, 3, generator=gen) * 4, torch.rand(2, 4, 3, generator=gen) + 0.5], -1
    )
    out = torch.full((2, 3, 32), 7.0)
    starts = torch.tensor([0, 2], dtype=torch.int32)
    merge_spans(out, part_acc, part_ml, starts, torch.tensor([41], dtype=torch.int32), 2, 16)
    spans = torch.tensor([3, 3, 3, 3, 3, 3])  # rows at 39 and 40: 3 spans each
    rows_acc = part_acc.permute(0, 2, 1, 3).reshape(6, 4, 32)
    rows_ml = part_ml.permute(0, 2, 1, 3).reshape(6, 4, 2)
    expected = merge_spans_torch(rows_acc, rows_ml, spans).view(2, 3, 32)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_rows_do_not_depend_on_m(dtype):
    """Row 20 of a 37-row product, and the same row alone or among 5 or 17 other rows
    (K and N not multiples of the tiles), with bias and residual."""
    gen = torch.Generator().manual_seed(1)
    k, n = 70, 45
    weight = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(37, k, generator=gen).to(dtype)
    residual = torch.randn(37, n, generator=gen).to(dtype)
    full = matmul(x, weight, bias, residual)
    assert_close(full, matmul_torch(x, weight, bias, residual), dtype)
    for rows, at in ((1, 0), (5, 3), (17, 16)):
        xs = torch.randn(rows, k, generator=gen).to(dtype)
        rs = torch.randn(rows, n, generator=gen).to(dtype)
        xs[at], rs[at] = x[20], residual[20]
        assert torch.equal(matmul(xs, weight, bias, rs)[at], full[20])
    assert_close(matmul(x, weight), matmul_torch(x, weight), dtype)


def test_matmul_refuses_operands_that_do_not_fit():
    x, weight = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="K = 8"):
        matmul(x, torch.randn(6, 9))
    with pytest.raises(ValueError, match=r"bias must be \[6\]"):
        matmul(x, weight, torch.randn(5))
    with pytest.raises(ValueError, match="residual"):
        matmul(x, weight, residual=torch.randn(4, 6).bfloat16())
    with pytest.raises(ValueError, match="unit stride"):
        matmul(torch.randn(8, 4).t(), weight)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel_rows(dtype):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(9, 1500, generator=gen) * 3).to(dtype)  # two 1024-column chunks
    weight = torch.randn(1500, generator=gen).to(dtype)
    together = rms_norm_triton(x, weight, 1e-5)
    assert torch.equal(together[4:5], rms_norm_triton(x[4:5], weight, 1e-5))
    assert_close(together, rms_norm_torch(x, weight, 1e-5), dtype)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-5, backend="triton"), together)
