"""EngineConfig: the host tier's default and its variable."""

from __future__ import annotations

import pytest

from chatsvc.engine.config import EngineConfig, SchedulerConfig


def test_host_tier_defaults_to_the_device_pool_on_cuda_and_none_on_cpu():
    assert EngineConfig(device="cpu").host_blocks_for(100) == 0
    assert EngineConfig(device="cuda").host_blocks_for(100) == 100
    assert EngineConfig(device="cuda:1").host_blocks_for(7) == 7


def test_host_tier_size_can_be_set_either_way():
    assert EngineConfig(device="cpu", num_host_blocks=32).host_blocks_for(100) == 32
    assert EngineConfig(device="cuda", num_host_blocks=0).host_blocks_for(100) == 0
    assert EngineConfig.from_env({"CHATSVC_NUM_HOST_BLOCKS": "64"}).host_blocks_for(8) == 64
    with pytest.raises(ValueError, match="num_host_blocks"):
        EngineConfig(num_host_blocks=-1).validate()


def test_the_scheduler_config_is_built_from_the_engine_config_alone():
    config = EngineConfig(max_num_batched_tokens=96, max_num_seqs=5, max_wait_steps=3)
    scheduler = config.scheduler
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (96, 5)
    assert (scheduler.max_wait_steps, scheduler.max_defer_steps) == (3, config.max_defer_steps)
    # One set of defaults and one validation: the scheduler's.
    assert EngineConfig().scheduler == SchedulerConfig()
    with pytest.raises(ValueError, match="max_defer_steps"):
        EngineConfig(max_defer_steps=-1).validate()


def test_the_wait_for_disk_loads_is_read_from_its_variable_as_seconds():
    config = EngineConfig.from_env({"CHATSVC_MAX_LOAD_GATHER_S": "0.25"})
    assert config.scheduler.max_load_gather_s == 0.25
    with pytest.raises(ValueError, match="CHATSVC_MAX_LOAD_GATHER_S"):
        EngineConfig.from_env({"CHATSVC_MAX_LOAD_GATHER_S": "soon"})
    with pytest.raises(ValueError, match="max_load_gather_s"):
        EngineConfig.from_env({"CHATSVC_MAX_LOAD_GATHER_S": "-1"})


def test_the_engine_builds_its_kernels_in_its_data_dir(smollm2_fp32, tmp_path, monkeypatch):
    from chatsvc.engine.engine import LLMEngine
    from kernels.cpu import native

    monkeypatch.setattr(native, "_build_dir", None)
    LLMEngine(EngineConfig(dtype="fp32", num_gpu_blocks=8, data_dir=str(tmp_path)), smollm2_fp32)
    assert native.build_dir() == tmp_path / "kernels"


def test_the_default_pool_holds_as_many_blocks_in_fp32_as_in_bf16(smollm2_fp32):
    import torch

    from chatsvc.engine.config import DEFAULT_KV_CACHE_BYTES

    shape = smollm2_fp32.model.kv_shape(16)
    fp32, bf16 = shape.block_bytes(torch.float32), shape.block_bytes(torch.bfloat16)
    assert fp32 == 2 * bf16
    default = EngineConfig()
    assert default.kv_cache_bytes is None
    blocks = DEFAULT_KV_CACHE_BYTES // bf16
    # A CPU without native bf16 serves fp32: the same blocks, in twice the bytes.
    assert default.num_blocks_for(fp32, bf16) == default.num_blocks_for(bf16, bf16) == blocks
    # Bytes given are bytes: fp32 then holds half the blocks.
    given = EngineConfig.from_env({"CHATSVC_KV_CACHE_BYTES": str(DEFAULT_KV_CACHE_BYTES)})
    assert given.num_blocks_for(fp32, bf16) == blocks // 2
    assert given.num_blocks_for(bf16, bf16) == blocks
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        EngineConfig(kv_cache_bytes=0).validate()


def test_int8_kv_holds_about_twice_the_blocks_in_the_same_bytes(smollm2_fp32):
    import torch

    from chatsvc.engine import config as engine_config
    from chatsvc.engine.config import DEFAULT_KV_CACHE_BYTES
    from kernels import kv_layout

    assert engine_config.KV_DTYPES == kv_layout.KV_DTYPES
    shape = smollm2_fp32.model.kv_shape(16)
    int8, bf16 = shape.block_bytes(torch.int8), shape.block_bytes(torch.bfloat16)
    parsed = EngineConfig.from_env({"CHATSVC_KV_DTYPE": "int8"})
    assert parsed.kv_dtype == "int8"
    # The default with int8 KV: the blocks the default bytes hold in int8.
    assert parsed.num_blocks_for(int8, int8) == DEFAULT_KV_CACHE_BYTES // int8
    assert parsed.num_blocks_for(int8, int8) >= 1.9 * EngineConfig().num_blocks_for(bf16, bf16)
    given = EngineConfig(kv_cache_bytes=100 * bf16, kv_dtype="int8")
    assert given.num_blocks_for(int8, int8) == 100 * bf16 // int8 >= 190
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig.from_env({"CHATSVC_KV_DTYPE": "fp8"})


def test_bf16_kv_under_an_fp32_model_holds_the_default_blocks_in_half_the_bytes(
    smollm2_fp32, monkeypatch
):
    import torch

    from chatsvc.engine.engine import LLMEngine

    assert EngineConfig.from_env({"CHATSVC_KV_DTYPE": "bf16"}).kv_dtype == "bf16"
    floats = LLMEngine(EngineConfig(dtype="fp32"), smollm2_fp32)
    engine = LLMEngine(EngineConfig(dtype="fp32", kv_dtype="bf16"), smollm2_fp32)
    stats, pool = engine.cache_stats(), engine.runner.kv_pool
    assert stats["kv_dtype"] == "bfloat16" and pool.dtype == torch.bfloat16
    # The default pool: the same blocks, half the bytes.
    assert stats["device"]["total"] == floats.cache_stats()["device"]["total"]
    assert 2 * pool.nbytes == floats.runner.kv_pool.nbytes
    # Bytes given: twice the blocks of fp32 KV.
    block = smollm2_fp32.model.kv_shape(16).block_bytes(torch.float32)
    given = {"dtype": "fp32", "kv_cache_bytes": 40 * block}
    assert LLMEngine(EngineConfig(**given), smollm2_fp32).num_gpu_blocks == 40
    assert LLMEngine(EngineConfig(**given, kv_dtype="bf16"), smollm2_fp32).num_gpu_blocks == 80
    monkeypatch.setenv("CHATSVC_KERNEL_BACKEND", "triton")  # off CUDA: the interpreter's
    with pytest.raises(ValueError, match="invariant kernels only"):
        config = EngineConfig(dtype="fp32", kv_dtype="bf16", num_gpu_blocks=8, invariant=False)
        LLMEngine(config, smollm2_fp32)


def test_an_int8_kv_engine_names_its_dtype_and_refuses_kernels_that_cannot_read_it(
    smollm2_fp32, monkeypatch
):
    from chatsvc.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(dtype="fp32", kv_dtype="int8"), smollm2_fp32)
    stats = engine.cache_stats()
    assert stats["kv_dtype"] == "int8" and engine.runner.kv_pool.dtype.itemsize == 1
    assert stats["block_bytes"] == smollm2_fp32.model.kv_shape(16).block_bytes(
        engine.runner.kv_pool.dtype
    )
    monkeypatch.setenv("CHATSVC_KERNEL_BACKEND", "triton")  # off CUDA: the interpreter's
    with pytest.raises(ValueError, match="invariant kernels only"):
        config = EngineConfig(dtype="fp32", kv_dtype="int8", num_gpu_blocks=8, invariant=False)
        LLMEngine(config, smollm2_fp32)
