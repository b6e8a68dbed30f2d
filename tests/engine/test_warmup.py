"""The warm-up before serving: its shapes fit the scheduler, and it leaves the cache as
it found it (no block, no index entry, no statistic, no byte of the KV pool)."""

from __future__ import annotations

import pytest
import torch

from chatsvc.engine.warmup import warm_up_shapes
from tests.engine.test_engine import greedy, make_engine, prompt, run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("max_num_seqs", "max_batched", "max_context"),
    [(64, 512, 8192), (16, 256, 512), (1, 512, 8192), (8, 4, 2048), (4, 512, 40), (1, 1, 2)],
)
def test_every_shape_fits_the_schedulers_limits(max_num_seqs, max_batched, max_context):
    shapes = warm_up_shapes(max_num_seqs, max_batched, max_context)
    assert shapes and shapes[0].name == "decode x1"
    for shape in shapes:
        rows = shape.num_decodes + (1 if shape.chunk else 0)
        assert 1 <= rows <= max_num_seqs, shape
        assert shape.num_decodes + shape.chunk <= max_batched, shape
        assert shape.context + max(shape.chunk, 1) <= max_context, shape
    if max_batched > 1 and max_context > max_batched:
        assert any(s.chunk == max_batched and s.context == 0 for s in shapes), "no full chunk"


def test_warm_up_changes_nothing_the_cache_holds_or_counts(smollm2_fp32):
    engine = make_engine(smollm2_fp32, max_num_seqs=8, max_num_batched_tokens=128)
    pool = engine.runner.kv_pool.clone()
    stats = engine.cache_stats()

    ran = engine.warm_up(budget_s=600)

    expected = warm_up_shapes(8, 128, engine.max_context_len)
    assert [shape.name for shape in ran] == [shape.name for shape in expected]
    assert all(shape.seconds > 0 for shape in ran)
    assert engine.cache_stats() == stats
    assert engine.cache_stats()["device"]["free"] == engine.num_gpu_blocks
    assert torch.equal(engine.runner.kv_pool, pool), "the warm-up wrote into the KV pool"
    engine.check_integrity()

    # And it serves exactly what an engine without a warm-up serves.
    cold = make_engine(smollm2_fp32, max_num_seqs=8, max_num_batched_tokens=128)
    request = greedy("r", prompt(engine, "Name a color."), max_tokens=8)
    warm_answer = run(engine, [request])[("r", 0)][0]
    assert warm_answer == run(cold, [request])[("r", 0)][0]


def test_the_budget_and_a_stop_end_it_between_shapes(smollm2_fp32):
    engine = make_engine(smollm2_fp32, max_num_seqs=8, max_num_batched_tokens=128)
    assert engine.warm_up(budget_s=0) == []
    assert [s.name for s in engine.warm_up(600, stop=lambda: True)] == []
    calls = []

    def stop_after_one() -> bool:
        calls.append(1)
        return len(calls) > 1

    assert [s.name for s in engine.warm_up(600, stop=stop_after_one)] == ["decode x1"]
