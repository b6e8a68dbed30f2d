"""AsyncEngine when its thread dies: every waiter fails at once, nothing hangs, nobody is served.

The death is injected into the real engine (real model): a step or a command
that raises what no request owns, as a bug in the scheduler or the cache would.
"""

from __future__ import annotations

import asyncio

import pytest

from cache import Namespace
from chatsvc.engine.async_engine import AsyncEngine
from chatsvc.engine.config import EngineConfig
from chatsvc.protocol import EngineStoppedError, GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow
NS = Namespace(tenant_salt=b"tenant-d", label="d")


def _request(engine, request_id: str, max_tokens: int = 40) -> GenerationRequest:
    tokens = engine.chat_format.render([{"role": "user", "content": "Tell me a long story."}])
    return GenerationRequest(request_id, tokens, SamplingParams(max_tokens, 0.0), NS)


async def _started(engine: AsyncEngine, request_id: str):
    """A stream that has its first delta: a waiter the death must wake."""
    stream = engine.generate(_request(engine, request_id))
    first = await stream.__anext__()
    assert first.finish_reason is None
    return stream


async def _drain(stream) -> BaseException:
    try:
        async for _ in stream:
            pass
    except BaseException as error:  # noqa: BLE001 - what the waiter got is the result
        return error
    raise AssertionError("the stream ended normally after the engine died")


def _scenario(smollm2_fp32, kill):
    """Two streams in flight, then ``kill(core)`` makes the engine thread die."""

    async def scenario():
        engine = AsyncEngine(EngineConfig(dtype="fp32", num_gpu_blocks=64), loaded=smollm2_fp32)
        await engine.start()
        deaths: list[BaseException] = []
        died = asyncio.Event()

        def on_death(error: BaseException) -> None:
            deaths.append(error)
            died.set()

        engine.add_death_callback(on_death)
        try:
            streams = [await _started(engine, "a"), await _started(engine, "b")]
            kill(engine.engine)
            errors = await asyncio.gather(*(_drain(s) for s in streams))
            await died.wait()
            assert all(isinstance(e, EngineStoppedError) for e in errors), errors
            assert all("died" in str(e) for e in errors)
            assert len(deaths) == 1 and not engine.is_running
            assert isinstance(engine.failure, RuntimeError)
            # New calls fail at once: nothing waits for a thread that is gone.
            with pytest.raises(EngineStoppedError, match="died"):
                async for _ in engine.generate(_request(engine, "late")):
                    pass
            with pytest.raises(EngineStoppedError):
                engine.cache_stats()
            with pytest.raises(EngineStoppedError):
                await engine.abort("a")
            # A callback added after the death still hears of it, once.
            late: list[BaseException] = []
            engine.add_death_callback(late.append)
            await asyncio.sleep(0)
            assert late == [engine.failure]
        finally:
            await engine.stop()
        assert len(deaths) == 1  # stop() after a death is not a second one

    asyncio.run(scenario())


def test_an_exception_escaping_a_step_kills_the_thread_and_fails_every_waiter(
    smollm2_fp32, monkeypatch
):
    def kill(core):
        def broken_schedule():
            raise RuntimeError("injected: the scheduler's bookkeeping broke")

        monkeypatch.setattr(core.scheduler, "schedule", broken_schedule)

    _scenario(smollm2_fp32, kill)


def test_an_exception_in_command_handling_kills_the_thread(smollm2_fp32, monkeypatch):
    def kill(core):
        real_add = core.add_request

        def add_request(request):
            if request.request_id == "killer":
                raise RuntimeError("injected: admission broke after changing state")
            return real_add(request)

        monkeypatch.setattr(core, "add_request", add_request)

    async def scenario():
        engine = AsyncEngine(EngineConfig(dtype="fp32", num_gpu_blocks=64), loaded=smollm2_fp32)
        await engine.start()
        try:
            stream = await _started(engine, "a")
            kill(engine.engine)
            with pytest.raises(EngineStoppedError, match="died"):
                async for _ in engine.generate(_request(engine, "killer")):
                    pass
            assert isinstance(await _drain(stream), EngineStoppedError)
            assert isinstance(engine.failure, RuntimeError)
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_a_bad_request_is_refused_and_the_engine_goes_on(smollm2_fp32):
    # The refusals callers expect (RequestValidationError) are not a death.
    async def scenario():
        engine = AsyncEngine(EngineConfig(dtype="fp32", num_gpu_blocks=64), loaded=smollm2_fp32)
        await engine.start()
        try:
            bad = GenerationRequest("bad", [10**9], SamplingParams(4, 0.0), NS)
            with pytest.raises(ValueError, match="outside"):
                async for _ in engine.generate(bad):
                    pass
            deltas = [d async for d in engine.generate(_request(engine, "ok", max_tokens=3))]
            assert deltas[-1].finish_reason in ("stop", "length") and engine.is_running
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_abort_ends_a_waiting_stream_with_an_abort_delta(smollm2_fp32):
    async def scenario():
        engine = AsyncEngine(EngineConfig(dtype="fp32", num_gpu_blocks=64), loaded=smollm2_fp32)
        await engine.start()
        try:
            stream = await _started(engine, "a")
            await engine.abort("a")
            rest = [d async for d in stream]
            assert rest and rest[-1].finish_reason == "abort"
            assert engine.cache_stats()["device"]["used"] == 0
        finally:
            await engine.stop()

    asyncio.run(scenario())
