"""AsyncEngine on the real model: streaming, cancellation, errors."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cache import Namespace
from chatsvc.engine.async_engine import AsyncEngine
from chatsvc.engine.config import EngineConfig
from chatsvc.protocol import (
    EngineStoppedError,
    GenerationRequest,
    RequestTooLargeError,
    SamplingParams,
)

pytestmark = pytest.mark.slow
NS = Namespace(tenant_salt=b"tenant-b", label="b")


def _request(engine, request_id, max_tokens=6, question="Name a color."):
    tokens = engine.chat_format.render([{"role": "user", "content": question}])
    return GenerationRequest(request_id, tokens, SamplingParams(max_tokens, 0.0), NS)


async def consume_quietly(engine, request_id):
    async for _ in engine.generate(_request(engine, request_id, max_tokens=40)):
        pass


def test_stream_cancel_and_refuse(smollm2_fp32):
    async def scenario():
        config = EngineConfig(dtype="fp32", num_gpu_blocks=32, debug_checks=True)
        engine = AsyncEngine(config, loaded=smollm2_fp32)
        await engine.start()
        try:
            # Two streams at once; each ends with one final delta carrying metrics.
            async def collect(request):
                return [d async for d in engine.generate(request)]

            a, b = await asyncio.gather(
                collect(_request(engine, "a")), collect(_request(engine, "b", 4, "Say hi."))
            )
            for deltas, limit in ((a, 6), (b, 4)):
                assert deltas[-1].finish_reason in ("stop", "length")
                assert deltas[-1].metrics.completion_tokens == sum(len(d.token_ids) for d in deltas)
                assert len(deltas) <= limit
            assert engine.cache_stats()["device"]["used"] == 0

            # Leaving the stream early frees the request's blocks at once.
            stream = engine.generate(_request(engine, "c", max_tokens=40))
            first = await stream.__anext__()
            assert first.finish_reason is None
            assert engine.cache_stats()["device"]["used"] > 0
            await stream.aclose()
            assert engine.cache_stats()["device"]["used"] == 0

            # A cancelled consumer task aborts too.
            started = asyncio.Event()

            async def consume():
                async for _ in engine.generate(_request(engine, "d", max_tokens=40)):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert engine.cache_stats()["device"]["used"] == 0
            engine.check_integrity()

            # Cancelled while its "add" still waits for the engine thread: the thread
            # must skip the cancelled command and keep serving later requests.
            for attempt in range(3):
                early = asyncio.create_task(consume_quietly(engine, f"early{attempt}"))
                await asyncio.sleep(0)
                early.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await early
            after = [d async for d in engine.generate(_request(engine, "after", 3))]
            assert after[-1].finish_reason in ("stop", "length")
            assert engine.cache_stats()["device"]["used"] == 0

            # A request that can never fit gets a clear error, and nothing changes.
            huge = _request(engine, "e", max_tokens=2000)
            with pytest.raises(RequestTooLargeError, match="blocks"):
                async for _ in engine.generate(huge):
                    pass
            assert engine.cache_stats()["num_sequences"] == 0
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_the_engine_thread_builds_the_engine_and_a_load_error_reaches_start(monkeypatch):
    # The engine (model load and prepack included) is built on the engine thread, so
    # torch's OpenMP work stays on one thread (see the async_engine module docstring).
    from chatsvc.engine import async_engine

    built_on: list[str] = []
    real_engine = async_engine.LLMEngine

    def recording_engine(config, loaded=None):
        built_on.append(threading.current_thread().name)
        return real_engine(config, loaded)

    monkeypatch.setattr(async_engine, "LLMEngine", recording_engine)

    async def scenario():
        engine = AsyncEngine(EngineConfig(model="random:tiny-llama", dtype="fp32"))
        await engine.start()
        try:
            assert built_on == ["chatsvc-engine"]
            assert engine.model_name == "random:tiny-llama"
        finally:
            await engine.stop()

        broken = AsyncEngine(EngineConfig(model="random:gpt-5", dtype="fp32"))
        with pytest.raises(ValueError, match="gpt-5"):
            await broken.start()
        assert broken._thread is None and broken.engine is None
        with pytest.raises(EngineStoppedError):
            async for _ in broken.generate(_request(engine, "x")):
                pass

    asyncio.run(scenario())
