"""The Triton kernels over bf16 KV under fp32 rows (``CHATSVC_KV_DTYPE=bf16``) against
the torch references, under Triton's CPU interpreter: the KV write (the same bits, each
value rounded to nearest even) and the invariant span attention; the other attention
kernels refuse such a cache.

Run by ``test_triton_interpreted.py`` in its ``TRITON_INTERPRET=1`` subprocess, beside
``triton_checks.py`` (see there). By hand:

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/kernels/triton_checks_kv_bf16.py -q
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from kernel_cases import assert_close, extend_inputs, extend_oracle, make_paged_case, slots_of
from test_kv_bf16 import rows_with_edge_values, same_bits

import kernels
from kernels import invariance

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 (see the module docstring)")


def test_bf16_write_kv_triton_rounds_as_torch():
    cases = {
        backend: make_paged_case([20, 9], 8, 3, 64, kv_dtype=torch.bfloat16)
        for backend in ("torch", "triton")
    }
    first = cases["torch"]
    head, tail = slots_of(first, 0, torch.tensor([19, 0, 7])), slots_of(first, 1, torch.tensor([8]))
    slots = torch.cat([head, torch.tensor([-1]), tail])
    key = rows_with_edge_values(5, 3, 64)
    value = -key.flip(0)
    for backend, case in cases.items():
        kernels.write_kv(case.k_cache, case.v_cache, key, value, slots, backend=backend)
    assert same_bits(cases["triton"].pool, cases["torch"].pool)
    kept = slots >= 0
    written = cases["triton"].k_cache.flatten(0, 1)[slots[kept]]
    assert same_bits(written, key[kept].to(torch.bfloat16))


@pytest.mark.parametrize(
    ("lens", "q_lens"), [([13, 40, 70], [1, 1, 1]), ([40, 16, 70], [7, 1, 30])]
)
def test_bf16_span_attention_triton_matches_the_torch_reference(lens, q_lens):
    case = make_paged_case(lens, 8, 2, 64, torch.float32, kv_dtype=torch.bfloat16)
    query, starts = extend_inputs(case, q_lens, 6)
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens)
    with mock.patch.object(invariance, "SPAN_TOKENS", 32):
        out = kernels.paged_extend_attention(*args, 0.125, backend="triton")
        ref = kernels.paged_extend_attention(*args, 0.125, backend="torch")
    assert_close(out, ref, torch.float32)
    assert_close(out, extend_oracle(case, query, q_lens), torch.float32)
    with pytest.raises(ValueError, match="invariant kernels only"):
        kernels.paged_extend_attention(*args, 0.125, backend="triton", invariant=False)
