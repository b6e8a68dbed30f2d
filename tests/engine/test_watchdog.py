"""The engine's watchdog: an engine that holds requests and makes no progress is
stopped as dead (every waiter fails, the stacks are logged); a working or idle one
never is.

The watchdog alone with a thread standing in for the engine's, then the real engine
(real model) with a stall injected into its step: one that never returns, and one
that returns without ever computing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from cache import Namespace
from chatsvc.engine.async_engine import AsyncEngine
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.watchdog import EngineStalledError, Watchdog
from chatsvc.protocol import EngineStoppedError, GenerationRequest, SamplingParams

NS = Namespace(tenant_salt=b"tenant-w", label="w")


class _Calls:
    """on_stall's calls, and an Event set at the first."""

    def __init__(self) -> None:
        self.errors: list[EngineStalledError] = []
        self.event = threading.Event()

    def __call__(self, error: EngineStalledError) -> None:
        self.errors.append(error)
        self.event.set()


def _beating(
    watchdog: Watchdog, until: threading.Event, end: threading.Event, every_s: float
) -> threading.Thread:
    """A stand-in for the engine thread: beats until ``until``, then hangs until ``end``."""

    def beat() -> None:
        while not until.wait(every_s):
            watchdog.beat()
        end.wait()

    thread = threading.Thread(target=beat, name="stand-in-engine", daemon=True)
    thread.start()
    return thread


def test_a_thread_that_beats_is_never_stopped_and_one_that_stops_beating_is(caplog):
    calls = _Calls()
    watchdog = Watchdog(2.0, calls, lambda: "queues of the stand-in")
    done, end = threading.Event(), threading.Event()
    engine = _beating(watchdog, done, end, 0.05)
    watchdog.start(engine)
    try:
        assert not calls.event.wait(5.0)  # 2.5 timeouts of beats: quiet
        with caplog.at_level(logging.CRITICAL, logger="chatsvc.engine.watchdog"):
            done.set()  # the stand-in stops beating
            assert calls.event.wait(30.0)
            time.sleep(1.5)  # more looks: still one call
        assert len(calls.errors) == 1 and "no progress" in str(calls.errors[0])
        text = caplog.text
        assert "queues of the stand-in" in text
        # Every thread's stack, the watched one's first.
        assert text.index('Thread "stand-in-engine"') < text.index('Thread "MainThread"')
    finally:
        watchdog.stop()
        end.set()


def test_a_paused_watchdog_waits_and_a_process_that_did_not_run_starts_the_count_again():
    offset = [0.0]  # the clock jumps by this: the process was stopped, then went on

    def clock() -> float:
        return time.monotonic() + offset[0]

    calls = _Calls()
    watchdog = Watchdog(1.0, calls, lambda: "", clock=clock)
    watchdog.pause()
    watchdog.start(threading.current_thread())
    try:
        assert not calls.event.wait(3.0)  # paused (the warm-up): 3 timeouts, quiet
        watchdog.resume()
        offset[0] += 600.0  # ten minutes the watchdog did not see pass
        assert not calls.event.wait(0.5)  # half a timeout after: the count started again
        assert calls.event.wait(30.0)  # then no beat for a timeout: stopped
        assert len(calls.errors) == 1
    finally:
        watchdog.stop()


def test_a_timeout_of_zero_is_refused():
    with pytest.raises(ValueError, match="timeout_s"):
        Watchdog(0, _Calls(), lambda: "")
    with pytest.raises(ValueError, match="watchdog_timeout_s"):
        EngineConfig(watchdog_timeout_s=-1).validate()


# -- the real engine ----------------------------------------------------------------


def _request(engine: AsyncEngine, request_id: str, max_tokens: int) -> GenerationRequest:
    tokens = engine.chat_format.render([{"role": "user", "content": "Tell me a long story."}])
    return GenerationRequest(request_id, tokens, SamplingParams(max_tokens, 0.0), NS)


async def _collect(engine: AsyncEngine, request_id: str, max_tokens: int):
    """The stream's deltas, or the error that ended it."""
    deltas = []
    try:
        async for delta in engine.generate(_request(engine, request_id, max_tokens)):
            deltas.append(delta)
    except EngineStoppedError as error:
        return error
    return deltas


def _engine(smollm2_fp32, timeout_s: float) -> AsyncEngine:
    config = EngineConfig(
        dtype="fp32", num_gpu_blocks=64, warm_up_s=3.0, watchdog_timeout_s=timeout_s
    )
    return AsyncEngine(config, loaded=smollm2_fp32)


@pytest.mark.slow
def test_a_working_and_an_idle_engine_are_not_stopped(smollm2_fp32):
    # Warm-up (3 s, not watched), a generation of many steps, then idle: with a
    # timeout shorter than the warm-up and than the idle time, nothing fires.
    async def scenario():
        engine = _engine(smollm2_fp32, 2.0)
        await engine.start()
        try:
            await engine.warm_up()
            deltas = await _collect(engine, "long", 48)
            assert not isinstance(deltas, Exception), deltas
            assert deltas[-1].finish_reason in ("stop", "length")
            await asyncio.sleep(5.0)  # idle for two and a half timeouts
            assert engine.is_running and engine.failure is None
            again = await _collect(engine, "again", 4)
            assert not isinstance(again, Exception), again
        finally:
            await engine.stop()

    asyncio.run(scenario())


def _stalled_scenario(smollm2_fp32, monkeypatch, stall, stuck: bool):
    """Two streams in flight, then ``stall(core, release)`` makes the engine stop
    progressing; the watchdog (1 s) must fail both and stop the engine, and the thread
    (``stuck``: it stays in the step until ``release``) ends without storing anything
    to disk."""

    async def scenario():
        engine = _engine(smollm2_fp32, 1.0)
        await engine.start()
        core = engine.engine
        closed: list[bool] = []
        monkeypatch.setattr(core, "close", lambda: closed.append(True))
        deaths: list[BaseException] = []
        engine.add_death_callback(deaths.append)
        release = threading.Event()
        thread = engine._thread
        try:
            streams = [engine.generate(_request(engine, rid, 200)) for rid in ("a", "b")]
            for stream in streams:
                assert (await stream.__anext__()).finish_reason is None
            stall(core, release)
            for stream in streams:
                with pytest.raises(EngineStoppedError, match="no progress"):
                    async for _ in stream:
                        pass
            await asyncio.sleep(0)
            assert len(deaths) == 1 and isinstance(deaths[0], EngineStalledError)
            assert not engine.is_running
            assert isinstance(await _collect(engine, "late", 4), EngineStoppedError)
            # The stalled thread is not waited for: stop() returns while it is stuck.
            await asyncio.wait_for(engine.stop(), 30)
            if stuck:
                assert thread.is_alive()
        finally:
            release.set()
            await engine.stop()
        thread.join(60)
        assert not thread.is_alive()
        assert closed == []  # a stalled engine's state never reaches the disk tier

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_step_that_never_returns_is_stopped_and_every_waiter_fails(smollm2_fp32, monkeypatch):
    def stall(core, release: threading.Event) -> None:
        real_step = core.step

        def step():
            release.wait()  # a kernel's threads waiting on each other, for good
            return real_step()

        monkeypatch.setattr(core, "step", step)

    _stalled_scenario(smollm2_fp32, monkeypatch, stall, stuck=True)


@pytest.mark.slow
def test_a_loop_that_steps_without_computing_is_stopped(smollm2_fp32, monkeypatch):
    def stall(core, release: threading.Event) -> None:
        real_step = core.step

        def step():
            if release.is_set():
                return real_step()
            # A scheduling bug: every step plans nothing, and returns at once.
            core.progressed = False
            time.sleep(0.001)
            return []

        monkeypatch.setattr(core, "step", step)

    _stalled_scenario(smollm2_fp32, monkeypatch, stall, stuck=False)
