"""The warm-up before serving: its shapes fit the scheduler, and it leaves the cache as
it found it (no block, no index entry, no statistic, no byte of the KV pool); with a
disk tier, its disk load leaves the tier's files and statistics as they were too."""

from __future__ import annotations

import pytest
import torch

from chatsvc.engine.warmup import warm_up_shapes
from chatsvc.kv_metrics import TierTrafficCollector
from tests.engine.kv_fs import read_only_dir
from tests.engine.test_engine import greedy, make_engine, prompt, run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("max_num_seqs", "max_batched", "max_context"),
    [(64, 512, 8192), (16, 256, 512), (1, 512, 8192), (8, 4, 2048), (4, 512, 40), (1, 1, 2)],
)
def test_every_shape_fits_the_schedulers_limits(max_num_seqs, max_batched, max_context):
    shapes = warm_up_shapes(max_num_seqs, max_batched, max_context)
    assert shapes and shapes[0].name == "decode x1"
    assert not any(shape.disk for shape in shapes)
    with_disk = warm_up_shapes(max_num_seqs, max_batched, max_context, disk_load=True)
    assert [s for s in with_disk if not s.disk] == shapes
    assert [s.name for s in with_disk if s.disk] == ["disk load"]
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


def files_of(root) -> dict:
    """Every file under ``root`` with its size and modification time."""
    return {
        str(path.relative_to(root)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in root.rglob("*")
        if path.is_file()
    }


def metrics_of(engine) -> list:
    return [
        (sample.name, sample.labels, sample.value)
        for family in TierTrafficCollector(engine.cache_stats).collect()
        for sample in family.samples
    ]


def test_the_disk_load_changes_no_block_file_and_no_statistic(smollm2_fp32, tmp_path):
    kv = tmp_path / "kv"
    earlier = make_engine(
        smollm2_fp32, max_num_seqs=2, max_num_batched_tokens=16, kv_disk_dir=str(kv)
    )
    run(earlier, [greedy("r", prompt(earlier, "Name a color, then a fruit."), max_tokens=4)])
    earlier.close()
    engine = make_engine(
        smollm2_fp32, max_num_seqs=2, max_num_batched_tokens=16, kv_disk_dir=str(kv)
    )
    assert engine.disk_tier.num_found > 0
    tier = engine.disk_tier
    # The block the load goes into holds something other than zeros: written back as
    # anything but its own bytes, the pool would differ below.
    free = engine.cache.tiers.device.free_block_ids()[-1]
    engine.runner.kv_pool[free].normal_(generator=torch.Generator().manual_seed(1))
    pool = engine.runner.kv_pool.clone()
    stats, metrics, files = engine.cache_stats(), metrics_of(engine), files_of(kv)

    ran = [shape.name for shape in engine.warm_up(budget_s=600)]
    while tier.worker.num_queued:
        tier.worker.wait(0.05)

    # "disk load" alone: its outcome was "ok" (read back and verified in the pool block).
    assert ran[:4] == ["decode x1", "prefill 16", "extend 16 after 256", "disk load"]
    assert torch.equal(engine.runner.kv_pool, pool), "the disk load changed the pool"
    assert engine.cache_stats() == stats
    assert metrics_of(engine) == metrics
    assert files_of(kv) == files, "the disk load left a file or touched a block's"
    engine.check_integrity()

    # A directory that refuses writes: the load says so and still changes nothing.
    with read_only_dir(tier.directory.path):
        outcome = tier.warm_up_load(10.0)
    assert outcome.startswith("write failed"), outcome
    assert engine.cache_stats() == stats and files_of(kv) == files
    engine.close()
