"""The disk KV tier under LLMEngine with the real SmolLM2 (fp32): restarts, faults, loading.

Every engine here is a "restart" of the one before it: a new LLMEngine (empty
memory tiers) on the same directory. Exactness is checked against the same
model with the prefix cache off.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import shutil
import threading
import time

import pytest
import torch

from cache import Namespace
from cache.forget import owner_digest
from cache.hashing import ROOT_HASH, BlockHasher
from chatsvc.engine.async_engine import AsyncEngine
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine
from chatsvc.engine.kv_disk import jobs as kv_jobs
from chatsvc.engine.kv_disk import load_job as kv_load_job
from chatsvc.engine.kv_disk.fileformat import parse_name
from chatsvc.engine.kv_disk.fingerprint import model_fingerprint
from chatsvc.engine.loader import load_local
from chatsvc.protocol import GenerationRequest, SamplingParams
from tests.engine.kv_fs import fill, read_only_dir, small_filesystem

pytestmark = pytest.mark.slow
NS = Namespace(tenant_salt=b"tenant-a", label="a")
SYSTEM = "<|im_start|>system\nYou are a terse assistant. Answer in a few words.<|im_end|>\n"
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Name a river there."]


class Clock:
    """The tier's wall clock, stepped by the test (the write-retry pause)."""

    def __init__(self) -> None:
        self.now = 1.0e9

    def __call__(self) -> float:
        return self.now


def config(tmp_path=None, **overrides) -> EngineConfig:
    values = dict(dtype="fp32", block_size=16, num_gpu_blocks=96, debug_checks=True)
    if tmp_path is not None:
        values["kv_disk_dir"] = str(tmp_path / "kv")
    values.update(overrides)
    return EngineConfig(**values)


@contextlib.contextmanager
def engine_on(loaded, cfg: EngineConfig, clock=None):
    """An engine that is closed (its disk tier flushed and unlocked) on exit."""
    engine = LLMEngine(cfg, loaded=loaded)
    if clock is not None:
        engine.disk_tier.use_clock(clock)
    try:
        yield engine
    finally:
        engine.close()


def request(request_id, tokens, max_tokens=8, session=None, ns=NS):
    labels = {"session": session} if session else {}
    return GenerationRequest(request_id, tokens, SamplingParams(max_tokens, 0.0), ns, labels)


def run(engine, requests):
    """Run to completion; {request_id: (tokens, last delta)}."""
    for r in requests:
        engine.add_request(r)
    results: dict = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None, out.error
            tokens, _ = results.get(out.request_id, ([], None))
            results[out.request_id] = (tokens + out.delta.token_ids, out.delta)
    return results


def settle(engine) -> None:
    """Wait until the I/O thread has done what was queued and apply its results."""
    tier = engine.disk_tier
    while tier.worker.num_queued:
        tier.worker.wait(0.05)
    engine.apply_io(0.0)


def turn_prompt(engine, history, turn):
    text = f"<|im_start|>user\n{QUESTIONS[turn]}<|im_end|>\n<|im_start|>assistant\n"
    if turn == 0:
        text = SYSTEM + text
    return history + engine.chat_format.tokenize(text)


def converse(engine, turns, history=None, start=0, session=None):
    """Turns of one conversation; returns (outputs, metrics per turn, history).

    ``history`` ends with the last answer and its end-of-turn tokens, of which
    the engine computed all but the newest ones (see ``computed``).
    """
    history = list(history or [])
    outputs, metrics = [], []
    end = engine.chat_format.tokenize("<|im_end|>\n")
    for turn in range(start, start + turns):
        tokens = turn_prompt(engine, history, turn)
        out, last = run(engine, [request(f"t{turn}", tokens, session=session)])[f"t{turn}"]
        outputs.append(out)
        metrics.append(last.metrics)
        converse.computed = len(tokens) + len(out) - 1  # the last sampled token has no KV
        if out[-1] != end[0]:
            out = out + end[:1]
        history = tokens + out + end[1:]
    return outputs, metrics, history


def block_files(tmp_path):
    return sorted(p for p in (tmp_path / "kv").rglob("*.kv"))


@pytest.fixture(scope="module")
def reference(smollm2_fp32):
    """The whole conversation with the prefix cache off: the exact tokens."""
    engine = LLMEngine(config(enable_prefix_cache=False), loaded=smollm2_fp32)
    return converse(engine, 3)


def test_turn_after_a_restart_is_a_disk_hit_with_the_same_greedy_tokens(
    smollm2_fp32, tmp_path, reference
):
    with engine_on(smollm2_fp32, config(tmp_path)) as first:
        outputs, metrics, history = converse(first, 2)
        computed = converse.computed
        assert all(m.cached_tokens_by_tier["disk"] == 0 for m in metrics)
    assert len(block_files(tmp_path)) == computed // 16
    with engine_on(smollm2_fp32, config(tmp_path)) as second:
        assert second.disk_tier.num_found == len(block_files(tmp_path))
        third, metrics3, _ = converse(second, 1, history, start=2)
        hit = metrics3[0]
        # Everything the first engine computed (all full blocks) came back from disk.
        assert hit.cached_tokens_by_tier == {"device": 0, "host": 0, "disk": computed // 16 * 16}
        assert hit.cached_prompt_tokens == computed // 16 * 16
        stats = second.cache_stats()
        assert stats["hit_tokens_by_tier"]["disk"] == computed // 16 * 16
        assert stats["disk"]["loaded_blocks"] == computed // 16
        assert stats["disk"]["load_latency_s"]["count"] == computed // 16
        second.check_integrity()
    assert outputs + third == reference[0]


def test_a_different_model_dtype_or_block_size_never_loads_foreign_kv(
    smollm2_fp32, tmp_path, reference
):
    with engine_on(smollm2_fp32, config(tmp_path)) as first:
        _, _, history = converse(first, 1)
        fingerprint = first.disk_tier.fingerprint
        own_dir = first.disk_tier.directory.path
    shape = smollm2_fp32.model.kv_shape(16)
    other_dtype = model_fingerprint(smollm2_fp32, torch.bfloat16, shape, 0, None)
    other_bs = model_fingerprint(
        smollm2_fp32, torch.float32, smollm2_fp32.model.kv_shape(32), 0, None
    )
    assert len({fingerprint, other_dtype, other_bs}) == 3
    # The same weights in another layout (other sums, other KV bits): another fingerprint.
    other_layout = "plain" if smollm2_fp32.model.weight_layout != "plain" else "onednn"
    relaid = load_local(smollm2_fp32.path, torch.float32, "cpu", prepack_weights=other_layout)
    assert model_fingerprint(relaid, torch.float32, shape, 0, None) != fingerprint
    # int8 weights: their sums depend on how x is quantized, named by its group.
    int8 = load_local(smollm2_fp32.path, torch.float32, "cpu", weight_dtype="int8")
    int8_fingerprint = model_fingerprint(int8, torch.float32, shape, 0, None)
    assert int8_fingerprint != fingerprint
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("chatsvc.engine.kv_disk.fingerprint.ACTIVATION_GROUP", 64)
        assert model_fingerprint(int8, torch.float32, shape, 0, None) != int8_fingerprint
    # Other code computing the same sums (the torch kernels, another build of the C
    # kernels: another CPU's, another revision's) writes other bits: another fingerprint.
    assert model_fingerprint(smollm2_fp32, torch.float32, shape, 0, None) == fingerprint
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CHATSVC_KERNEL_BACKEND", "torch")
        assert model_fingerprint(smollm2_fp32, torch.float32, shape, 0, None) != fingerprint
        patch.delenv("CHATSVC_KERNEL_BACKEND")
        patch.setattr("kernels.cpu.native._loaded_sha256", "0" * 64)
        assert model_fingerprint(smollm2_fp32, torch.float32, shape, 0, None) != fingerprint
    with engine_on(smollm2_fp32, config(tmp_path, block_size=32)) as other:
        assert other.disk_tier.num_found == 0 and other.disk_tier.directory.path != own_dir

    # Another model of the same shape (one weight changed): its own directory, and
    # the first model's files copied into it are refused on load, deleted, counted.
    model_dir = tmp_path / "other-model"
    shutil.copytree(smollm2_fp32.path, model_dir)
    weights = sorted(model_dir.glob("*.safetensors"))[-1]
    with weights.open("r+b") as f:
        f.seek(-2, 2)
        byte = f.read(1)
        f.seek(-2, 2)
        f.write(bytes([byte[0] ^ 0x01]))
    other_model = load_local(model_dir, torch.float32, "cpu")
    with engine_on(other_model, config(tmp_path)) as probe:
        foreign_dir = probe.disk_tier.directory.path
        foreign_fingerprint = probe.disk_tier.fingerprint
        assert probe.disk_tier.num_found == 0 and foreign_dir != own_dir
    for path in own_dir.rglob("*.kv"):
        target = foreign_dir / path.parent.name / path.name
        target.parent.mkdir(mode=0o700, exist_ok=True)
        shutil.copy(path, target)
    no_cache = LLMEngine(config(enable_prefix_cache=False), loaded=other_model)
    expected, _, _ = converse(no_cache, 1, history, start=1)
    with engine_on(other_model, config(tmp_path)) as engine:
        assert engine.disk_tier.num_found > 0
        got, metrics, _ = converse(engine, 1, history, start=1)
        stats = engine.cache_stats()["disk"]
        assert metrics[0].cached_tokens_by_tier["disk"] == 0
        assert stats["dropped_blocks"]["foreign"] > 0 and stats["loaded_blocks"] == 0
    assert got == expected
    # The foreign files are gone; what is there now the other model wrote itself.
    for path in foreign_dir.rglob("*.kv"):
        assert path.read_bytes()[24:40] == foreign_fingerprint != fingerprint
    # An engine that keeps other fingerprints' directories 0 days removes the idle ones
    # at start (the first model's, the block size 32 one's), never its own.
    with engine_on(other_model, config(tmp_path, kv_disk_keep_other_days=0)) as engine:
        assert engine.disk_tier.num_found > 0
    kept = {path.name for path in (tmp_path / "kv").iterdir() if path.is_dir()}
    assert kept <= {foreign_dir.name} | {p.name for p in (tmp_path / "kv").glob(".removing-*")}
    assert foreign_dir.exists() and not own_dir.exists()


def test_flipped_and_truncated_files_are_misses_deleted_and_counted(
    smollm2_fp32, tmp_path, reference
):
    with engine_on(smollm2_fp32, config(tmp_path)) as first:
        outputs, _, history = converse(first, 2)
        computed = converse.computed
    by_name = {parse_name(p.name).hash: p for p in block_files(tmp_path)}
    # The history's chain from the root: damage its 2nd block (a flip) and its 3rd (a cut).
    hasher, parent, chain = BlockHasher(16), ROOT_HASH, []
    for i in range(computed // 16):
        parent = hasher.hash_block(parent, tuple(history[i * 16 : (i + 1) * 16]), NS.key(i, 16))
        chain.append(parent)
    assert len(chain) >= 3 and set(chain) == set(by_name)
    flipped, truncated = by_name[chain[1]], by_name[chain[2]]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x40
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:5000])
    with engine_on(smollm2_fp32, config(tmp_path)) as second:
        third, metrics, _ = converse(second, 1, history, start=2)
        stats = second.cache_stats()["disk"]
        assert metrics[0].cached_tokens_by_tier["disk"] == 16  # the block before the flip
        assert stats["dropped_blocks"]["corrupt"] == 2
        settle(second)
        # Recomputed and written again: the files are whole once more.
        assert {parse_name(p.name).hash for p in block_files(tmp_path)} >= set(chain)
    assert outputs + third == reference[0]


def test_write_errors_stop_writes_with_one_warning_and_recover(
    smollm2_fp32, tmp_path, monkeypatch, caplog
):
    clock = Clock()
    real_write = kv_jobs._write_file

    def full_disk(path, parts, fsync):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_jobs, "_write_file", full_disk)
    caplog.set_level(logging.INFO, logger="chatsvc.engine.kv_disk")
    cfg = config(tmp_path, kv_disk_retry_s=30)
    with engine_on(smollm2_fp32, cfg, clock) as engine:
        outputs, _, history = converse(engine, 2)  # serving continues
        settle(engine)
        stats = engine.cache_stats()["disk"]
        warnings = [r for r in caplog.records if "writes stop" in r.getMessage()]
        assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
        assert stats["write_errors"] >= 1 and stats["writes_paused"]
        assert stats["dropped_blocks"]["write_error"] > stats["write_errors"]  # paused: dropped
        assert not block_files(tmp_path)

        monkeypatch.setattr(kv_jobs, "_write_file", real_write)  # space is back
        clock.now += 31
        converse(engine, 1, history, start=2)
        settle(engine)
        stats = engine.cache_stats()["disk"]
        assert not stats["writes_paused"] and stats["stored_blocks"] > 0
        assert any("writes resumed" in r.getMessage() for r in caplog.records)
        assert block_files(tmp_path)


def test_a_full_filesystem_stops_writes_and_space_coming_back_resumes_them(
    smollm2_fp32, tmp_path, caplog
):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="chatsvc.engine.kv_disk")
    with small_filesystem(tmp_path / "kv", 8 << 20) as mount:
        cfg = config(tmp_path, kv_disk_bytes=1 << 30, kv_disk_retry_s=30)
        with engine_on(smollm2_fp32, cfg, clock) as engine:
            filler = fill(mount)
            outputs, _, history = converse(engine, 1)
            settle(engine)
            stats = engine.cache_stats()["disk"]
            assert stats["writes_paused"] and stats["write_errors"] >= 1
            assert sum("writes stop" in r.getMessage() for r in caplog.records) == 1
            assert not any(p.name.startswith(".tmp-") for p in mount.rglob("*"))
            filler.unlink()
            clock.now += 31
            converse(engine, 1, history, start=1)
            settle(engine)
            assert engine.cache_stats()["disk"]["stored_blocks"] > 0
            assert not engine.cache_stats()["disk"]["writes_paused"]


def test_an_unwritable_data_dir_turns_the_tier_off_with_a_clear_log_line(
    smollm2_fp32, tmp_path, caplog, reference
):
    caplog.set_level(logging.WARNING, logger="chatsvc.engine.kv_disk")
    with read_only_dir(tmp_path / "ro") as ro:
        engine = LLMEngine(config(kv_disk_dir=str(ro / "kv")), loaded=smollm2_fp32)
        assert engine.disk_tier is None
        lines = [r.getMessage() for r in caplog.records]
        assert any("KV disk tier off" in m and "not writable" in m for m in lines), lines
        outputs, _, _ = converse(engine, 1)
        engine.close()
    assert outputs == reference[0][:1]


def test_loads_never_stall_the_step_loop_and_an_abort_waits_for_them(
    smollm2_fp32, tmp_path, monkeypatch
):
    with engine_on(smollm2_fp32, config(tmp_path)) as first:
        _, _, history = converse(first, 2)
    gate = threading.Event()
    real_run = kv_load_job.LoadJob.run

    def gated(job):
        gate.wait()
        real_run(job)

    monkeypatch.setattr(kv_load_job.LoadJob, "run", gated)
    with engine_on(smollm2_fp32, config(tmp_path)) as engine:
        engine.add_request(request("disk", turn_prompt(engine, history, 2)))
        other = engine.chat_format.tokenize("<|im_start|>user\nSay hi.<|im_end|>\n")
        engine.add_request(request("mem", other, max_tokens=4))
        finished = set()
        while "mem" not in finished:
            for out in engine.step():
                assert out.error is None
                if out.delta.finish_reason:
                    finished.add(out.request_id)
        # The other request ran to its end while the disk request's loads were held.
        (seq,) = engine.scheduler.loading.values()
        assert seq.request.request_id == "disk" and seq.status.value == "loading"
        assert engine.abort_request("disk")[0].delta.finish_reason == "abort"
        assert engine.cache_stats()["device"]["used"] > 0  # the loads still write into them
        gate.set()
        while engine.has_unfinished_requests:
            engine.step()
        assert engine.cache_stats()["device"]["used"] == 0
        engine.check_integrity()


def test_a_full_write_queue_drops_stores_and_never_blocks(smollm2_fp32, tmp_path, monkeypatch):
    gate = threading.Event()
    real_run = kv_jobs.WriteJob.run

    def gated(job):
        gate.wait()
        real_run(job)

    monkeypatch.setattr(kv_jobs.WriteJob, "run", gated)
    with engine_on(smollm2_fp32, config(tmp_path, kv_disk_queue_blocks=1)) as engine:
        converse(engine, 1)  # would hang here if a store waited for the disk
        stats = engine.cache_stats()["disk"]
        assert stats["dropped_blocks"]["queue_full"] > 0
        gate.set()
        settle(engine)
        assert engine.cache_stats()["disk"]["stored_blocks"] == 1


def test_write_back_stores_only_dropped_blocks_then_the_rest_at_shutdown(
    smollm2_fp32, tmp_path, reference
):
    cfg = config(tmp_path, kv_disk_write="back")
    with engine_on(smollm2_fp32, cfg) as first:
        outputs, _, history = converse(first, 2)
        computed = converse.computed
        settle(first)
        assert first.cache_stats()["disk"]["stored_blocks"] == 0  # nothing dropped yet
    stored = len(block_files(tmp_path))
    assert stored == computed // 16  # written by the clean shutdown
    with engine_on(smollm2_fp32, cfg) as second:
        third, metrics, _ = converse(second, 1, history, start=2)
        assert metrics[0].cached_tokens_by_tier["disk"] == stored * 16
    assert outputs + third == reference[0]


def test_forgetting_a_session_deletes_its_files_and_keeps_what_others_use(smollm2_fp32, tmp_path):
    with engine_on(smollm2_fp32, config(tmp_path)) as engine:
        _, _, a_history = converse(engine, 2, session="A")
        # B began exactly like A (same system prompt and first question, greedy): its
        # whole history is a prefix of A's, made of blocks A computed.
        _, _, b_history = converse(engine, 1, session="B")
        b_computed = converse.computed
        settle(engine)
        a_owner = owner_digest(NS.tenant_salt, "A").hex()
        owned = [p for p in block_files(tmp_path) if f"-{a_owner}-" in p.name]
        assert len(owned) == len(block_files(tmp_path)) > len(b_history) // 16
        shared = 0
        while a_history[shared] == b_history[shared]:
            shared += 1
            if shared == len(b_history):
                break
        outputs, counts, done = engine.forget_session("A", a_history, NS, keep_tokens=shared)
        done.result(timeout=60)
        assert outputs == [] and counts["disk"] == len(owned) - shared // 16
        left = [p for p in block_files(tmp_path) if f"-{a_owner}-" in p.name]
        assert len(left) == shared // 16
        # B keeps its whole history cached.
        hit = engine.cache.match_prefix(b_history, NS).num_cached_tokens
        assert hit == b_computed // 16 * 16
        engine.check_integrity()


def test_forgetting_a_session_aborts_its_running_turn_and_deletes_that_turn_too(
    smollm2_fp32, tmp_path
):
    with engine_on(smollm2_fp32, config(tmp_path)) as engine:
        _, _, history = converse(engine, 1, session="A")
        engine.add_request(request("t1", turn_prompt(engine, history, 1), 24, session="A"))
        while not any(s.output_token_ids for s in engine.scheduler.running):
            engine.step()
        outputs, counts, done = engine.forget_session("A", history, NS)
        assert [o.delta.finish_reason for o in outputs] == ["abort"]
        done.result(timeout=60)
        while engine.has_unfinished_requests:
            engine.step()
        settle(engine)
        assert block_files(tmp_path) == []
        assert engine.cache_stats()["indexed_blocks"] == 0
        engine.check_integrity()


def test_a_turn_that_reaches_the_engine_after_its_session_was_deleted_leaves_no_kv(
    smollm2_fp32, tmp_path
):
    """DELETE /sessions/{id} while a turn of it was on its way (locked, rendered, not
    yet in the engine): the turn runs, and its blocks are forgotten once it ends."""
    with engine_on(smollm2_fp32, config(tmp_path)) as engine:
        _, _, history = converse(engine, 1, session="A")
        outputs, _, done = engine.forget_session("A", history, NS)
        done.result(timeout=60)
        assert outputs == [] and engine.cache_stats()["indexed_blocks"] == 0
        late = request("late", turn_prompt(engine, history, 1), 8, session="A")
        run(engine, [late])
        settle(engine)
        assert engine.cache_stats()["indexed_blocks"] == 0
        assert block_files(tmp_path) == []
        engine.check_integrity()


def test_an_idle_engine_still_takes_in_the_writes_its_last_step_queued(smollm2_fp32, tmp_path):
    """A request that ends in its prefill step queues its blocks' writes in that very
    step. Only the engine thread takes a finished write in (index entry, buffer
    back), so the idle thread collects them as they end instead of sleeping until
    the next request (a benchmark waiting for them hung there)."""

    async def scenario():
        engine = AsyncEngine(config(tmp_path), loaded=smollm2_fp32)
        await engine.start()
        try:
            tokens = turn_prompt(engine, [], 0)
            async for _ in engine.generate(request("only-prefill", tokens, max_tokens=1)):
                pass
            deadline = time.monotonic() + 60  # a readiness wait: the writes take ms
            while (disk := engine.cache_stats()["disk"])["writing"]:
                assert time.monotonic() < deadline, disk
                await asyncio.sleep(0.05)
            full_blocks = len(tokens) // 16
            assert full_blocks >= 2
            assert disk["stored_blocks"] == full_blocks == len(block_files(tmp_path))
        finally:
            await engine.stop()

    asyncio.run(scenario())


def session_requests(engine, histories, spaces, turn):
    return [
        request(f"s{i}", turn_prompt(engine, history, turn), ns=ns)
        for i, (history, ns) in enumerate(zip(histories, spaces, strict=True))
    ]


def test_sessions_returning_together_prefill_in_one_step_after_their_loads(smollm2_fp32, tmp_path):
    # Three sessions sharing the system prompt (public) come back at once after a
    # restart: the first one loads it with its history, the twins wait for it and
    # then load their own histories, and all three prefill together, not the first
    # one alone a step before the others.
    cfg = config(tmp_path, max_load_gather_s=30.0)
    histories: list[list[int]] = [[], [], []]
    with engine_on(smollm2_fp32, cfg) as first:
        end = first.chat_format.tokenize("<|im_end|>\n")
        num_system = len(first.chat_format.tokenize(SYSTEM))
        spaces = [
            Namespace(tenant_salt=f"s{i}".encode(), label=f"s{i}", shared_prefix_len=num_system)
            for i in range(3)
        ]
        for turn in range(2):
            reqs = session_requests(first, histories, spaces, turn)
            results = run(first, reqs)
            for i, r in enumerate(reqs):
                out = results[r.request_id][0]
                histories[i] = r.prompt_token_ids + out + end[int(out[-1] == end[0]) :]
        settle(first)
    reqs = session_requests(first, histories, spaces, 2)
    expected = run(LLMEngine(config(enable_prefix_cache=False), loaded=smollm2_fp32), reqs)

    with engine_on(smollm2_fp32, cfg) as engine:
        plans = []
        real_schedule = engine.scheduler.schedule

        def recorded():
            out = real_schedule()
            plans.append(out)
            return out

        engine.scheduler.schedule = recorded
        got = run(engine, reqs)
        loads = [[seq.request.request_id for seq, _ in out.loads] for out in plans if out.loads]
        assert loads == [["s0"], ["s1", "s2"]]
        computing = next(out for out in plans if out.scheduled)
        assert {item.seq.request.request_id for item in computing.scheduled} == {"s0", "s1", "s2"}
        # Every session's own history came from disk, the system prompt from the
        # first one's load.
        by_tier = [got[f"s{i}"][1].metrics.cached_tokens_by_tier for i in range(3)]
        assert by_tier[0]["device"] == 0 and by_tier[1]["device"] == by_tier[2]["device"] > 0
        history = len(histories[0]) // 16 * 16 - 16
        assert all(tiers["disk"] + tiers["device"] >= history for tiers in by_tier)
    assert {r: tokens for r, (tokens, _) in got.items()} == {
        r: tokens for r, (tokens, _) in expected.items()
    }


@pytest.mark.parametrize(("kv_dtype", "name"), [("int8", "int8"), ("bf16", "bfloat16")])
def test_narrower_kv_restarts_warm_and_never_meets_model_dtype_kv_on_disk(
    smollm2_fp32, tmp_path, kv_dtype, name
):
    """The KV dtype is part of the fingerprint: an int8-KV (or bf16-KV) engine's blocks
    come back to such an engine after a restart (an int8 block's rows and scales: the
    same greedy tokens as the engine that computed them), and an engine with KV in the
    model dtype (fp32) on the same directory finds none of them (nor they its)."""
    narrow = config(tmp_path, kv_dtype=kv_dtype)
    with engine_on(smollm2_fp32, narrow) as first:
        assert first.cache_stats()["kv_dtype"] == name
        outputs, _, history = converse(first, 1)
        computed = converse.computed
        narrow_dir = first.disk_tier.directory.path
        expected, _, _ = converse(first, 1, history, start=1)
    with engine_on(smollm2_fp32, config(tmp_path)) as floats:
        assert floats.disk_tier.num_found == 0 and floats.disk_tier.directory.path != narrow_dir
        _, metrics, _ = converse(floats, 1, history, start=1)
        assert metrics[0].cached_tokens_by_tier["disk"] == 0
    with engine_on(smollm2_fp32, narrow) as second:
        assert second.disk_tier.num_found >= computed // 16
        again, metrics, _ = converse(second, 1, history, start=1)
        assert metrics[0].cached_tokens_by_tier["disk"] >= computed // 16 * 16
        assert again == expected
        second.check_integrity()
