"""The step's I/O seam (chatsvc.engine.step_io): the engine without a disk tier steps
through the no-op StepIO, and the disk tier's StepIO runs without a scheduler."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from cache import KVCacheManager, Namespace
from cache.plan import DiskLoad
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine
from chatsvc.engine.kv_disk import DiskSettings, DiskStepIO
from chatsvc.engine.kv_disk.directory import TierDirectory
from chatsvc.engine.step_io import FinishedLoad, NoStepIO, SequenceLoads
from chatsvc.protocol import GenerationRequest, SamplingParams

BS = 16
FP = b"F" * 16
NS = Namespace(tenant_salt=b"tenant-a", label="a")
POOL_SHAPE = (4, 2, 2, BS, 3, 64)  # [blocks, layers, K/V, tokens, heads, dim]
TOKENS = list(range(1000, 1000 + BS))


class RecordingIO(NoStepIO):
    """The no-op StepIO, noting which of its methods the step calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def finished_loads(self):
        self.calls.append("finished_loads")
        return super().finished_loads()

    def submit(self, loads):
        self.calls.append("submit")
        return super().submit(loads)

    def store(self, stores):
        self.calls.append("store")
        super().store(stores)

    def wait(self, timeout_s):
        self.calls.append("wait")


@pytest.mark.slow
def test_without_a_disk_tier_the_engine_steps_through_the_no_op_step_io(smollm2_fp32, monkeypatch):
    def no_disk_code(*args, **kwargs):
        raise AssertionError("the disk tier's code ran in an engine without one")

    for name in ("finished_loads", "submit", "store", "wait"):
        monkeypatch.setattr(DiskStepIO, name, no_disk_code)
    config = EngineConfig(dtype="fp32", block_size=BS, num_gpu_blocks=64, debug_checks=True)
    engine = LLMEngine(config, loaded=smollm2_fp32)
    assert engine.disk_tier is None and type(engine.step_io) is NoStepIO
    io = engine.step_io = RecordingIO()
    prompt = engine.chat_format.tokenize("<|im_start|>user\nHello there<|im_end|>\n")
    engine.add_request(GenerationRequest("r", prompt, SamplingParams(4, 0.0), NS))
    num_steps = 0
    while engine.has_unfinished_requests:
        assert all(out.error is None for out in engine.step())
        num_steps += 1
    assert num_steps >= 4
    # Each step: loads that landed, the step's loads (none), its write-through (none).
    assert io.calls == ["finished_loads", "submit", "store"] * num_steps
    assert not engine.has_unapplied_io


def finished(io: DiskStepIO, timeout_s: float = 10.0) -> list[FinishedLoad]:
    """The first non-empty ``finished_loads`` (the I/O thread runs meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while not (done := io.finished_loads()):
        assert time.monotonic() < deadline, "the loads never ended"
        io.wait(0.05)
    return done


def test_the_disk_tier_takes_stores_and_loads_and_hands_back_finished_loads(tmp_path):
    pool = torch.randn(POOL_SHAPE, generator=torch.Generator().manual_seed(0))
    cache = KVCacheManager(POOL_SHAPE[0], BS)
    directory = TierDirectory(tmp_path / "kv", FP).open()
    settings = DiskSettings(budget_bytes=1 << 20, queue_blocks=2, load_threads=1)
    nbytes = pool[0].numel() * pool.element_size()
    io = DiskStepIO(cache, directory, FP, BS, nbytes, pool, None, settings)
    try:
        # A computed block, stored write-through as the engine does after a step.
        cache.allocate("a", [*TOKENS, 1], NS)
        cache.mark_computed("a", BS + 1)
        stores = cache.take_stores()
        io.store(stores)
        assert [s.block_id for s in stores] == cache.block_table("a")[:1]
        while io.has_unapplied_io:
            io.wait(0.05)
            assert io.finished_loads() == []  # a write ends no load
        assert io.stats_snapshot()["stored_blocks"] == 1

        # Read it back into another pool block, as the loads of an admitted sequence.
        block = next(iter(cache.chain(TOKENS, NS).blocks(0, 1)))
        target = next(b for b in range(POOL_SHAPE[0]) if b not in cache.block_table("a"))
        pool[target].zero_()
        load = DiskLoad(0, target, block.hash, block.parent_hash, block.token_ids, block.ns_key)
        seq = SimpleNamespace(seq_id="b")  # any handle with an id: no scheduler here
        assert io.submit([SequenceLoads(seq, (load,))]) == []
        assert finished(io) == [FinishedLoad(seq, 1)]
        assert torch.equal(pool[target], pool[stores[0].block_id])

        # A block the disk does not hold ends at once, with nothing usable.
        gone = load._replace(hash=b"\x00" * 16)
        other = SimpleNamespace(seq_id="c")
        assert io.submit([SequenceLoads(other, (gone,))]) == [FinishedLoad(other, 0)]
        assert io.finished_loads() == []
    finally:
        io.close()
