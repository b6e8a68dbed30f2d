"""kernels.step_kernels: a step's kernels bound once give what the public functions give
layer by layer, and refuse calls that do not fit the step they were bound for."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import make_paged_case, share_prefix

from kernels.cpu_attention import native_max_query
from kernels.extend_metadata import extend_metadata
from kernels.step_kernels import CheckedStep, NativeStep, StepTensors

NUM_KV_HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 16


def _step(dtype, q_lens, lens):
    """Both bindings of one step over a two-layer pool: decodes, short turns (some
    sharing a prefix) and a prefill chunk longer than the native limit."""
    case = make_paged_case(lens, BLOCK, NUM_KV_HEADS, HEAD_DIM, dtype, spare_blocks=0)
    for member in (1, 2):
        share_prefix(case, 0, member, 6)
    starts = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    slots = torch.cat(
        [
            case.block_tables[b, torch.arange(n - q, n) // BLOCK].long() * BLOCK
            + torch.arange(n - q, n) % BLOCK
            for b, (n, q) in enumerate(zip(lens, q_lens, strict=True))
        ]
    )
    metadata = extend_metadata(
        case.block_tables,
        starts,
        case.context_lens,
        BLOCK,
        GROUP,
        NUM_KV_HEADS * HEAD_DIM * case.pool.element_size(),
        dtype,
        native_max_query=native_max_query(dtype, HEAD_DIM),
    )
    step = StepTensors(case.pool, slots, case.block_tables, starts, case.context_lens)
    scale, eps = 1 / math.sqrt(HEAD_DIM), 1e-5
    bound = NativeStep(
        step, num_q_heads=NUM_KV_HEADS * GROUP, scale=scale, eps=eps, metadata=metadata
    )
    checked = CheckedStep(
        step._replace(kv_pool=case.pool.clone()),
        is_decode=False,
        max_query_len=max(q_lens),
        scale=scale,
        eps=eps,
        write_index=None,
        metadata=metadata,
    )
    return case, bound, checked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bound_step_equals_the_public_functions(dtype):
    q_lens, lens = [1, 1, 3, 40, 1], [130, 200, 99, 300, 17]
    case, bound, checked = _step(dtype, q_lens, lens)
    gen = torch.Generator().manual_seed(0)
    tokens, hq = sum(q_lens), NUM_KV_HEADS * GROUP

    x = torch.randn(tokens, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    assert torch.equal(bound.rms_norm(x, weight), checked.rms_norm(x, weight))
    gate_up = torch.randn(tokens, 2 * 256, generator=gen).to(dtype)
    assert torch.equal(bound.swiglu(gate_up), checked.swiglu(gate_up))

    # q and k as views inside a fused projection, as the model passes them.
    qkv = torch.randn(tokens, hq + 2 * NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    angles = torch.rand(tokens, 1, HEAD_DIM, generator=gen) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rotated = qkv.clone()
    bound.rope_(qkv[:, : hq + NUM_KV_HEADS], cos, sin)
    checked.rope_(rotated[:, : hq + NUM_KV_HEADS], cos, sin)
    assert torch.equal(qkv, rotated)

    q, k, v = qkv[:, :hq], qkv[:, hq : hq + NUM_KV_HEADS], qkv[:, hq + NUM_KV_HEADS :]
    for layer in (0, 1):
        bound.write_kv(layer, k, v)
        checked.write_kv(layer, k, v)
        assert torch.equal(bound.kv_pool, checked.step.kv_pool)
        assert torch.equal(bound.attention(layer, q), checked.attention(layer, q))


def test_a_bound_step_refuses_calls_of_another_shape():
    q_lens, lens = [1, 1, 3, 40, 1], [130, 200, 99, 300, 17]
    case, bound, _ = _step(torch.bfloat16, q_lens, lens)
    before = case.pool.clone()
    short = torch.zeros(sum(q_lens) - 1, 9, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="46-token step"):
        bound.attention(0, short)
    with pytest.raises(ValueError, match="46-token step"):
        bound.write_kv(0, short[:, :3], short[:, :3])
    with pytest.raises(ValueError, match="46-token step"):
        bound.rope_(short, short[:, :1], short[:, :1])
    full = torch.zeros(sum(q_lens), 9, HEAD_DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside the pool's 2"):
        bound.attention(2, full)
    with pytest.raises(ValueError, match="outside the pool's 2"):
        bound.write_kv(-1, full[:, :3], full[:, :3])
    assert torch.equal(case.pool, before)


def test_binding_refuses_pools_the_c_kernels_do_not_take():
    case, bound, _ = _step(torch.bfloat16, [1, 1, 3, 40, 1], [130, 200, 99, 300, 17])
    starts = torch.tensor([0, 1, 2, 5, 45, 46], dtype=torch.int32)
    step = StepTensors(
        case.pool.half(), torch.zeros(46, dtype=torch.long), case.block_tables, starts,
        case.context_lens,
    )  # fmt: skip
    with pytest.raises(ValueError, match="fp32/bf16"):
        NativeStep(step, num_q_heads=9, scale=0.125, eps=1e-5, metadata=bound.metadata)
    with pytest.raises(ValueError, match=r"\[B \+ 1\]"):
        NativeStep(
            step._replace(kv_pool=case.pool, query_start_loc=starts[:-1]),
            num_q_heads=9,
            scale=0.125,
            eps=1e-5,
            metadata=bound.metadata,
        )
