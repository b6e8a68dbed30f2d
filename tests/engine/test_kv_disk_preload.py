"""The disk tier's preload after a restart (kv_disk/preload.py), with the real SmolLM2 (fp32).

One conversation is computed once per module and its block files copied for each
engine, so every engine here is a restart on the same files.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
import torch

from cache import Namespace
from chatsvc.engine.async_engine import AsyncEngine
from chatsvc.engine.kv_disk.fileformat import header_len
from chatsvc.kv_metrics import TierTrafficCollector
from tests.engine.test_kv_disk_engine import (
    NS,
    Clock,
    config,
    converse,
    engine_on,
    request,
    run,
    settle,
    turn_prompt,
)

pytestmark = pytest.mark.slow
SESSION = "s1"
OTHER = Namespace(tenant_salt=b"tenant-b", label="b")


@pytest.fixture(scope="module")
def conversation(smollm2_fp32, tmp_path_factory):
    """Two turns of one session on an engine with a disk tier: (its directory, the
    history, the tokens the engine computed)."""
    root = tmp_path_factory.mktemp("conversation")
    with engine_on(smollm2_fp32, config(root)) as first:
        _, _, history = converse(first, 2, session=SESSION)
        settle(first)
    return root / "kv", history, converse.computed


def restart(conversation, tmp_path, name: str):
    """A copy of the conversation's directory for one engine; its config's tmp_path."""
    shutil.copytree(conversation[0], tmp_path / name / "kv")
    return tmp_path / name


def preload_all(engine) -> int:
    """Start the preload and run the idle engine's I/O until it ends; blocks planned."""
    planned = engine.start_preload()
    deadline = time.monotonic() + 60  # a readiness wait: the reads take ms
    while engine.has_unapplied_io:
        assert time.monotonic() < deadline, engine.disk_tier.preload.snapshot()
        engine.apply_io(0.05)
    return planned


def without_timings(stats: dict) -> dict:
    """cache_stats() less what differs between two engines doing the same: the load
    latencies, the directory's name and the preload's own section."""
    disk = {
        k: v
        for k, v in stats["disk"].items()
        if k not in ("load_latency_s", "dir", "preload", "queued_jobs")
    }
    return {**stats, "disk": disk}


def test_a_preloaded_turn_reads_no_file_and_ends_as_a_loaded_one(
    smollm2_fp32, tmp_path, conversation
):
    _, history, computed = conversation
    full_blocks = computed // 16
    # A fixed budget: the default one follows the free space, which the two would not share.
    preloaded = config(
        restart(conversation, tmp_path, "p"), kv_disk_bytes=1 << 30, kv_disk_preload_bytes=1 << 30
    )
    plain = config(
        restart(conversation, tmp_path, "n"), kv_disk_bytes=1 << 30, kv_disk_preload_bytes=0
    )
    results, stats = {}, {}
    for name, cfg in (("preload", preloaded), ("plain", plain)):
        with engine_on(smollm2_fp32, cfg) as engine:
            prompt = turn_prompt(engine, history, 2)
            if name == "preload":
                assert preload_all(engine) == full_blocks
                snapshot = engine.cache_stats()["disk"]["preload"]
                assert snapshot["state"] == "done"
                assert snapshot["read_blocks"] == snapshot["staged_blocks"] == full_blocks
                # The memory tiers know nothing of it: not a block of the pool is taken.
                assert engine.cache_stats()["device"]["free"] == engine.num_gpu_blocks
                assert engine.cache_stats()["indexed_blocks"] == 0
                # No file left to read: a load on the request path would miss.
                for path in (tmp_path / "p" / "kv").rglob("*.kv"):
                    path.unlink()
            # Another tenant with the very same tokens finds nothing (its chained hashes
            # differ), and leaves the staged blocks to the session's tenant.
            other = run(engine, [request("other", prompt, ns=OTHER)])["other"][1]
            assert other.metrics.cached_tokens_by_tier["disk"] == 0
            if name == "preload":
                assert engine.cache_stats()["disk"]["preload"]["staged_blocks"] == full_blocks
            tokens, last = run(engine, [request("turn", prompt, session=SESSION)])["turn"]
            results[name] = tokens
            tiers = last.metrics.cached_tokens_by_tier
            assert tiers == {"device": 0, "host": 0, "disk": full_blocks * 16}, name
            settle(engine)
            engine.check_integrity()
            stats[name] = engine.cache_stats()
    assert results["preload"] == results["plain"]
    # Loaded from memory, the blocks are what loads from the files left: verified,
    # indexed, evictable, counted as disk hits and loads.
    assert without_timings(stats["preload"]) == without_timings(stats["plain"])
    assert stats["preload"]["disk"]["load_misses"] == 0
    preload = stats["preload"]["disk"]["preload"]
    assert preload["used_blocks"] == full_blocks and preload["staged_blocks"] == 0
    samples = {
        sample.labels["outcome"]: sample.value
        for family in TierTrafficCollector(lambda: stats["preload"]).collect()
        if family.name == "chatsvc_kv_disk_preload_blocks"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert samples == {"read": full_blocks, "used": full_blocks, "dropped": 0}


def test_the_preload_is_bounded_and_lets_go_of_deleted_and_stale_blocks(
    smollm2_fp32, tmp_path, conversation
):
    _, history, computed = conversation
    clock = Clock()
    block_bytes = smollm2_fp32.model.kv_shape(16).block_bytes(torch.float32)
    file_bytes = header_len(16) + block_bytes
    root = restart(conversation, tmp_path, "p")
    bound = computed // 16 - 1  # one block less than the session has
    assert bound >= 2
    cfg = config(root, kv_disk_preload_bytes=bound * file_bytes + file_bytes // 2)
    with engine_on(smollm2_fp32, cfg, clock) as engine:
        tier = engine.disk_tier
        # A request in the engine holds blocks of the pool while the preload reads.
        engine.add_request(request("busy", turn_prompt(engine, [], 1), max_tokens=4))
        engine.step()
        before = engine.cache.stats_snapshot()
        assert engine.start_preload() == bound
        while tier.preload.state == "running":
            engine.apply_io(0.05)
        assert engine.cache.stats_snapshot() == before  # nothing of the pool taken
        preload = tier.stats_snapshot()["preload"]
        assert preload["read_blocks"] == preload["staged_blocks"] == bound
        # The blocks nearest the root of the session's chain (its most recent).
        chain = engine.cache.chain(history[:computed], NS)
        assert all(block.hash in tier.preload for block in chain.blocks(0, bound))
        while engine.has_unfinished_requests:
            engine.step()

        # Deleting the session deletes its staged copies with its files.
        _, counts, done = engine.forget_session(SESSION, history, NS)
        done.result(timeout=60)
        assert counts["disk"] == computed // 16
        preload = tier.stats_snapshot()["preload"]
        assert preload["staged_blocks"] == 0 and preload["dropped_blocks"] == bound
        engine.check_integrity()

    # What no request takes is let go some minutes after the preload ended.
    cfg = config(restart(conversation, tmp_path, "q"), kv_disk_preload_bytes=1 << 30)
    with engine_on(smollm2_fp32, cfg, clock) as engine:
        tier = engine.disk_tier
        assert preload_all(engine) == computed // 16
        clock.now += tier.preload.keep_s - 1
        engine.apply_io(0.0)
        assert tier.preload.num_staged == computed // 16
        clock.now += 2
        engine.apply_io(0.0)
        preload = tier.stats_snapshot()["preload"]
        assert preload["staged_blocks"] == 0 and preload["dropped_blocks"] == computed // 16


def test_the_service_engine_preloads_after_its_warm_up_while_idle(
    smollm2_fp32, tmp_path, conversation
):
    """AsyncEngine: the warm-up's end starts the preload and the idle engine thread
    drives it to the end; the session's next turn then takes every block from it."""
    _, history, computed = conversation
    cfg = config(restart(conversation, tmp_path, "p"), warm_up_s=0.0)

    async def scenario():
        engine = AsyncEngine(cfg, loaded=smollm2_fp32)
        await engine.start()
        try:
            assert engine.cache_stats()["disk"]["preload"]["state"] == "not started"
            await engine.warm_up()
            deadline = time.monotonic() + 60  # a readiness wait: the reads take ms
            while (preload := engine.cache_stats()["disk"]["preload"])["state"] != "done":
                assert time.monotonic() < deadline, preload
                await asyncio.sleep(0.02)
            assert preload["read_blocks"] == computed // 16
            turn = request("turn", turn_prompt(engine, history, 2), session=SESSION)
            async for delta in engine.generate(turn):
                metrics = delta.metrics
            assert metrics.cached_tokens_by_tier["disk"] == computed // 16 * 16
            assert engine.cache_stats()["disk"]["preload"]["used_blocks"] == computed // 16
        finally:
            await engine.stop()

    asyncio.run(scenario())
