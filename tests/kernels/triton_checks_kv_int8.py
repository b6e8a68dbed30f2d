"""The Triton kernels over int8 KV (kernels/kv_layout.py) against the torch references,
under Triton's CPU interpreter: the KV write and block copy (the same bytes, rows and
scales) and the invariant span attention.

Run by ``test_triton_interpreted.py`` in its ``TRITON_INTERPRET=1`` subprocess, beside
``triton_checks.py`` (see there). By hand:

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/triton_checks_kv_int8.py -q
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from kernel_cases import assert_close, extend_inputs, extend_oracle, make_paged_case, slots_of

import kernels
from kernels import invariance

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 (see the module docstring)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16])
def test_int8_write_kv_triton_matches_reference(block_size, dtype):
    cases = {
        backend: make_paged_case([20, 9], block_size, 3, 64, dtype, kv_dtype=torch.int8)
        for backend in ("torch", "triton")
    }
    first = cases["torch"]
    slots = torch.cat(
        [
            slots_of(first, 0, torch.tensor([19, 0, 7])),
            torch.tensor([-1]),
            slots_of(first, 1, torch.tensor([8])),
        ]
    )
    gen = torch.Generator().manual_seed(5)
    key = (torch.randn(5, 3, 64, generator=gen) * 4).to(dtype)
    value = torch.randn(5, 3, 64, generator=gen).to(dtype)
    key[2, 1] = 0.0  # a row of zeros: scale 0
    for backend, case in cases.items():
        kernels.write_kv(
            case.k_cache, case.v_cache, key, value, slots, backend=backend, scales=case.scales
        )
    assert torch.equal(cases["triton"].pool, cases["torch"].pool)


def test_int8_copy_blocks_triton_moves_rows_and_scales():
    case = make_paged_case([40], 8, 2, 64, kv_dtype=torch.int8, spare_blocks=4)
    pairs = torch.tensor([[3, 6], [0, 7], [2, 8]])
    expected = case.pool.clone()
    expected[pairs[:, 1]] = case.pool[pairs[:, 0]]
    kernels.copy_blocks(case.pool, case.pool, pairs, backend="triton")
    assert torch.equal(case.pool, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lens", "q_lens"),
    [([13, 40, 70], [1, 1, 1]), ([40, 16, 70], [7, 1, 30])],  # decodes; runs over spans
)
def test_int8_span_attention_triton_matches_the_torch_reference(lens, q_lens, dtype):
    """Triton's invariant kernel over int8 K/V against the torch reference (span tasks,
    dequantized as gathered), with spans of 32 keys so the contexts cross several."""
    case = make_paged_case(lens, 8, 2, 64, dtype, kv_dtype=torch.int8)
    query, starts = extend_inputs(case, q_lens, 6)
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens)
    with mock.patch.object(invariance, "SPAN_TOKENS", 32):
        out = kernels.paged_extend_attention(*args, 0.125, backend="triton", scales=case.scales)
        ref = kernels.paged_extend_attention(*args, 0.125, backend="torch", scales=case.scales)
    assert_close(out, ref, dtype)
    assert_close(out, extend_oracle(case, query, q_lens), dtype)
