"""The invariant torch attention (kernels.span_attention): right, and the same bits for a
token however its step is made (chunks, decodes, companions, order, threads).

The span is monkeypatched small (``kernels.invariance.SPAN_TOKENS``, read at call time)
so that contexts of a few dozen tokens cross several span boundaries; the shapes of the
real span are checked once against the oracle.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from invariance_cases import Piece, attend_pieces, mismatches, random_schedule, solo_outputs
from kernel_cases import assert_close, extend_inputs, extend_oracle, make_paged_case

import kernels
from kernels import invariance
from kernels.span_attention import attend_tasks, tasks_in_plain_ops
from kernels.span_metadata import span_metadata, task_rows

DTYPES = [torch.float32, torch.bfloat16]


def _attend(scale=0.125, **kwargs):
    def attend(query, k_cache, v_cache, tables, starts, lens):
        return kernels.paged_extend_attention(
            query, k_cache, v_cache, tables, starts, lens, scale, backend="torch", **kwargs
        )

    return attend


@pytest.fixture
def small_span(monkeypatch):
    monkeypatch.setattr(invariance, "SPAN_TOKENS", 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("group", "span", "lens", "q_lens"),
    [
        (1, 16, [70, 40, 17, 1], [70, 9, 1, 1]),  # a prompt, a chunk, decodes; 5 spans
        (3, 32, [70, 40, 17, 1], [70, 9, 1, 1]),
        (4, 256, [300, 17], [44, 1]),  # the real span: a chunk crossing 256
    ],
)
def test_spans_match_the_oracle(monkeypatch, group, span, lens, q_lens, dtype):
    monkeypatch.setattr(invariance, "SPAN_TOKENS", span)
    case = make_paged_case(lens, 8, 2, 64, dtype)
    query, starts = extend_inputs(case, q_lens, 2 * group)
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens)
    out = kernels.paged_extend_attention(*args, 1 / math.sqrt(64), backend="torch")
    assert out.dtype == dtype and out.shape == query.shape
    assert_close(out, extend_oracle(case, query, q_lens), dtype)


def test_every_task_has_one_shape(small_span):
    """Decodes, a chunk crossing spans and a prompt: all tasks [rows, S], rows = 8 here."""
    lens, q_lens = [40, 33, 20], [1, 20, 20]
    case = make_paged_case(lens, 8, 2, 32)
    _, starts = extend_inputs(case, q_lens, 6)
    plan = span_metadata(case.block_tables, starts, case.context_lens, 8, 3)
    assert plan.slots_per_task == 2 and task_rows(3, 2) == 6 and task_rows(1, 2) == 4
    assert {tuple(call.bias.shape[1:]) for call in plan.calls} == {(1, 6, 16)}
    # Single-token groups share one call, a task each: the decode at 39 in spans 0-2, and
    # the chunk 13..32's token 32 in span 2. Runs: the chunk's 20 tokens in span 0, its 17
    # from 16 on in span 1; the prompt's 20 in span 0, its 4 from 16 on in span 1.
    assert [call.slots.shape[0] for call in plan.calls] == [4, 10, 9, 10, 2]
    assert plan.num_states == 2 * sum(call.slots.shape[0] for call in plan.calls)
    assert plan.merge_rows.tolist() == [0, *range(4, 21), *range(37, 41)]
    assert plan.direct_rows.tolist() == [*range(1, 4), *range(21, 37)]
    # Keys past a context are listed to be zeroed, never read: 8 past 40, 15 past 33, 12.
    assert plan.keys_outside.numel() == 8 + 15 + 12


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prebuilt_plan_gives_the_same_bits_and_a_foreign_one_is_refused(small_span, dtype):
    lens, q_lens = [40, 33], [1, 20]
    case = make_paged_case(lens, 8, 2, 32, dtype)
    query, starts = extend_inputs(case, q_lens, 6)
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, 0.2)
    plan = span_metadata(case.block_tables, starts, case.context_lens, 8, 3)
    with_plan = kernels.paged_extend_attention(*args, backend="torch", metadata=plan)
    assert torch.equal(with_plan, kernels.paged_extend_attention(*args, backend="torch"))
    other = span_metadata(case.block_tables, starts.clamp(max=20), case.context_lens, 8, 3)
    with pytest.raises(ValueError, match="metadata built for"):
        kernels.paged_extend_attention(*args, backend="torch", metadata=other)
    with pytest.raises(ValueError, match="SpanMetadata"):
        kernels.paged_extend_attention(*args, backend="torch", metadata=("not", "a plan"))


batches = st.fixed_dictionaries(
    {
        "lens": st.lists(st.integers(1, 70), min_size=1, max_size=3),
        "group": st.sampled_from([1, 3, 4]),
        "block_size": st.sampled_from([4, 8, 16]),
        "bf16": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)


@settings(max_examples=15, deadline=None)
@given(batch=batches)
def test_a_rows_bits_do_not_depend_on_its_step(batch):
    """Hypothesis: random sequences over several spans of 16, each cut into random chunks
    and decodes and batched with the others' pieces in random order, give the bits of the
    sequence attended alone in one chunk (NaN keys past every piece's context)."""
    invariance_span = invariance.SPAN_TOKENS
    invariance.SPAN_TOKENS = 16
    try:
        dtype = torch.bfloat16 if batch["bf16"] else torch.float32
        case = make_paged_case(batch["lens"], batch["block_size"], 2, 32, dtype, batch["seed"])
        gen = torch.Generator().manual_seed(batch["seed"])
        queries = [
            torch.randn(n, 2 * batch["group"], 32, generator=gen).to(dtype) for n in batch["lens"]
        ]
        steps = random_schedule(random.Random(batch["seed"]), batch["lens"])
        assert mismatches(_attend(), case, queries, steps) == []
    finally:
        invariance.SPAN_TOKENS = invariance_span


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_thread_count_leaves_the_bits_alone(small_span, dtype):
    """Alone on one thread, in batched steps on two: the same bits (G = 3, the SmolLM2
    shape, whose tasks are padded past the 3-row products that followed the thread)."""
    lens = [70, 45, 9]
    case = make_paged_case(lens, 8, 3, 64, dtype)
    gen = torch.Generator().manual_seed(3)
    queries = [torch.randn(n, 9, 64, generator=gen).to(dtype) for n in lens]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = solo_outputs(_attend(), case, queries)
        torch.set_num_threads(2)
        steps = random_schedule(random.Random(5), lens)
        steps.append([Piece(0, 69, 70), Piece(1, 44, 45), Piece(2, 8, 9)])  # three decodes
        assert mismatches(_attend(), case, queries, steps, alone) == []
    finally:
        torch.set_num_threads(threads)


def test_nan_keys_past_the_context_stay_out(small_span):
    """A decode at 20 of a sequence whose pool holds NaN from 21 on (the NaN are set by
    attend_pieces): finite, and equal to the oracle over the 21 real keys."""
    case = make_paged_case([40], 8, 2, 32)
    queries = [torch.randn(40, 6, 32)]
    (out,) = attend_pieces(_attend(1 / math.sqrt(32)), case, queries, [Piece(0, 20, 21)])
    assert torch.isfinite(out).all()
    truncated = make_paged_case([21], 8, 2, 32)
    truncated.keys[0], truncated.values[0] = case.keys[0][:21], case.values[0][:21]
    expected = extend_oracle(truncated, queries[0][20:21], [1])
    assert_close(out, expected, torch.float32)


def test_the_grouped_path_stays_for_invariant_false(small_span):
    """``invariant=False`` keeps the padded SDPA groups (kernels.extend_metadata): also
    right, and the path the public metadata of that kind is for."""
    lens, q_lens = [40, 33], [1, 20]
    case = make_paged_case(lens, 8, 2, 32)
    query, starts = extend_inputs(case, q_lens, 6)
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens)
    grouped = kernels.paged_extend_attention(
        *args, 1 / math.sqrt(32), backend="torch", invariant=False
    )
    assert_close(grouped, extend_oracle(case, query, q_lens), torch.float32)


def test_the_path_off_the_cpu_computes_the_same_tasks():
    """On CUDA the torch reference runs its tasks in plain torch ops (torch's flash kernel
    is the CPU's); here both on the same tasks, with masked keys past each row."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(5, 3, 6, 64, generator=gen)
    k, v = (torch.randn(1, 3, 256, 64, generator=gen).expand(5, -1, -1, -1) for _ in range(2))
    positions = torch.tensor([3, 100, 200, 255, 0])
    hidden = torch.arange(256) > positions[:, None, None, None]
    bias = torch.zeros(5, 1, 6, 256).masked_fill_(hidden, float("-inf"))
    flash_out, flash_lse = attend_tasks(q, k, v, bias, 0.125)
    plain_out, plain_lse = tasks_in_plain_ops(q, k, v, bias, 0.125)
    assert_close(plain_out, flash_out, torch.float32)
    assert_close(plain_lse, flash_lse, torch.float32)
