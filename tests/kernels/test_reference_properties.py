"""Property tests: the CPU paths (torch reference, native) agree with the dense oracle."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import (
    assert_close,
    decode_oracle,
    extend_inputs,
    extend_oracle,
    make_paged_case,
)

import kernels

batches = st.fixed_dictionaries(
    {
        "lens": st.lists(st.integers(1, 80), min_size=1, max_size=5),
        "block_size": st.sampled_from([8, 16, 32, 64]),
        "num_kv_heads": st.integers(1, 3),
        "group": st.sampled_from([1, 2, 3, 4]),
        "seed": st.integers(0, 2**16),
    }
)


@pytest.mark.parametrize("backend", ["torch", "native"])
@settings(max_examples=30, deadline=None)
@given(batch=batches)
def test_decode_on_random_batches(batch, backend):
    case = make_paged_case(
        batch["lens"], batch["block_size"], batch["num_kv_heads"], 32, seed=batch["seed"]
    )
    query = torch.randn(len(batch["lens"]), batch["num_kv_heads"] * batch["group"], 32)
    out = kernels.paged_decode_attention(
        query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.context_lens,
        1 / math.sqrt(32),
        backend=backend,
    )
    assert_close(out, decode_oracle(case, query), torch.float32)


@pytest.mark.parametrize("backend", ["torch", "native"])
@settings(max_examples=30, deadline=None)
@given(batch=batches, data=st.data())
def test_extend_on_random_batches(batch, data, backend):
    lens = batch["lens"]
    q_lens = [data.draw(st.integers(0, n)) for n in lens]
    case = make_paged_case(lens, batch["block_size"], batch["num_kv_heads"], 32, seed=batch["seed"])
    query, starts = extend_inputs(case, q_lens, batch["num_kv_heads"] * batch["group"])
    out = kernels.paged_extend_attention(
        query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        starts,
        case.context_lens,
        1 / math.sqrt(32),
        backend=backend,
    )
    assert_close(out, extend_oracle(case, query, q_lens), torch.float32)
