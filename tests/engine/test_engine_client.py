"""AsyncEngine is the implementation of chatsvc.protocol.EngineClient, member by member."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from chatsvc.engine.async_engine import AsyncEngine
from chatsvc.engine.config import EngineConfig
from chatsvc.protocol import EngineClient, EngineInfo, EngineStoppedError, Tokenizer


def _protocol_members() -> list[str]:
    return [
        name
        for name, value in vars(EngineClient).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    ]


def test_every_protocol_member_is_implemented_alike():
    members = _protocol_members()
    assert {"generate", "abort", "is_running", "failure", "info", "chat_format"} <= set(members)
    for name in members:
        wanted = inspect.getattr_static(EngineClient, name)
        # failure is a plain attribute the engine thread sets; reading it is the property.
        if name == "failure":
            assert "failure" in vars(AsyncEngine(EngineConfig()))
            continue
        have = inspect.getattr_static(AsyncEngine, name)
        if isinstance(wanted, property):
            assert isinstance(have, property), name
            continue
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(wanted), name
        assert inspect.isasyncgenfunction(have) or not inspect.isasyncgenfunction(wanted), name
        assert list(inspect.signature(have).parameters) == list(
            inspect.signature(wanted).parameters
        ), name


def test_an_engine_not_started_has_no_info():
    engine = AsyncEngine(EngineConfig())
    assert not engine.is_running and engine.failure is None
    with pytest.raises(EngineStoppedError):
        engine.info  # noqa: B018 - the property is the test


@pytest.mark.slow
def test_info_describes_the_started_engine(smollm2_fp32):
    async def scenario() -> EngineInfo:
        config = EngineConfig(dtype="fp32", num_gpu_blocks=24, num_host_blocks=4, block_size=16)
        engine = AsyncEngine(config, loaded=smollm2_fp32)
        await engine.start()
        try:
            assert isinstance(engine, EngineClient)
            assert isinstance(engine.tokenizer, Tokenizer)
            return engine.info
        finally:
            await engine.stop()

    info = asyncio.run(scenario())
    assert info.model_name == "SmolLM2-135M-Instruct"
    assert (info.dtype, info.device) == ("float32", "cpu")
    assert (info.num_gpu_blocks, info.num_host_blocks, info.block_size) == (24, 4, 16)
    assert info.max_context_len == smollm2_fp32.model.max_positions
    assert info.kernel_backend in ("native", "torch")
    assert (info.kernel_library_sha256 is not None) == (info.kernel_backend == "native")
