"""Server launch specs and start-up failure handling."""

from __future__ import annotations

import os

import pytest

from bench.live_server import free_port
from bench.multiturn.runner import resolve_model_dir
from bench.multiturn.servers import ServerStartError, build_spec, start_server


def test_specs_of_every_system(tmp_path):
    ours = build_spec("ours", tmp_path / "m", 1234, tmp_path / "d")
    nocache = build_spec("ours-nocache", tmp_path / "m", 1234, tmp_path / "d")
    assert ours.argv[1:4] == ("-m", "chatsvc", "serve") and "1234" in ours.argv
    assert ours.env["CHATSVC_ENABLE_PREFIX_CACHE"] == "1"
    assert nocache.env["CHATSVC_ENABLE_PREFIX_CACHE"] == "0"
    assert ours.env["CHATSVC_MODEL"] == str(tmp_path / "m")
    assert ours.env["CHATSVC_DATA_DIR"] == str(tmp_path / "d") and ours.data_dir == tmp_path / "d"
    assert ours.admin_cache_path == "/admin/cache" and ours.model is None
    hf = build_spec("hf", tmp_path / "m", 1234, tmp_path / "d", threads=2)
    cb = build_spec("hf-cb", tmp_path / "m", 1234, tmp_path / "d")
    assert hf.argv[1:3] == ("serve", str(tmp_path / "m")) and "--continuous-batching" not in hf.argv
    assert cb.argv[-1] == "--continuous-batching"
    assert hf.env["HF_HUB_OFFLINE"] == "1" and hf.env["OMP_NUM_THREADS"] == "2"
    assert hf.model == str(tmp_path / "m") and hf.admin_cache_path is None
    # Without --threads every system keeps the environment's setting (torch's default).
    for spec in (ours, cb):
        assert spec.env.get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")
    for spec in (ours, hf):
        assert "127.0.0.1" in spec.argv


def test_the_llama_cpp_spec_serves_the_shipped_gguf(tmp_path, monkeypatch):
    from chatsvc.engine.weights_gguf import default_gguf_path

    monkeypatch.setenv("LLAMA_SERVER", "/opt/llama/llama-server")
    llama = build_spec("llama", tmp_path / "m", 1234, tmp_path / "d", threads=2)
    assert llama.argv[0] == "/opt/llama/llama-server"
    assert llama.argv[llama.argv.index("-m") + 1] == str(default_gguf_path())
    assert llama.argv[llama.argv.index("-np") + 1] == "8"
    assert llama.argv[llama.argv.index("-t") + 1] == "2" and "1234" in llama.argv
    assert llama.ready_path == "/health" and llama.admin_cache_path is None


def test_unknown_system_raises(tmp_path):
    with pytest.raises(ValueError, match="unknown system"):
        build_spec("vllm", tmp_path, 1, tmp_path)


def test_free_port_is_bindable():
    assert 0 < free_port() < 65536


def test_model_dir_must_hold_a_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_dir(str(tmp_path))


@pytest.mark.slow
def test_server_that_exits_reports_its_log(tmp_path):
    # transformers serve on a directory without a model exits during start-up.
    with pytest.raises(ServerStartError, match="exited") as info:
        start_server("hf", tmp_path / "no-model", tmp_path / "logs", ready_timeout_s=120)
    # The message carries the log's tail, which names what went wrong.
    assert "no-model" in str(info.value)
