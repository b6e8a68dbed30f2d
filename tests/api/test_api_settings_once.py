"""The settings are read once: the engine's config and the data directory come with them.

Nothing below the settings reads the environment for them: the service builds its
engine from ``Settings.engine``, the paths and the kernels' build directory take
the configured directory (a variable set later changes nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from chatsvc import paths
from chatsvc.config import Settings, SettingsError
from chatsvc.service import build_engine
from kernels.cpu import native


def test_from_env_builds_the_engine_config_from_the_same_variables(tmp_path):
    env = {
        "CHATSVC_DATA_DIR": str(tmp_path / "data"),
        "CHATSVC_NUM_GPU_BLOCKS": "9",
        "CHATSVC_MAX_NUM_SEQS": "7",
        "CHATSVC_MAX_DEFER_STEPS": "0",
    }
    settings = Settings.from_env(env)
    engine = settings.engine
    assert (engine.num_gpu_blocks, engine.max_num_seqs, engine.data_dir) == (
        9,
        7,
        str(tmp_path / "data"),
    )
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_defer_steps) == (7, 0)
    assert settings.data_dir == tmp_path / "data"
    assert settings.redis_dir() == tmp_path / "data" / "redis"
    # The service's engine is that config, not a second reading of the environment.
    assert build_engine(settings).config is engine


def test_a_bad_engine_variable_is_a_settings_error():
    with pytest.raises(SettingsError, match="CHATSVC_NUM_GPU_BLOCKS"):
        Settings.from_env({"CHATSVC_NUM_GPU_BLOCKS": "many"})
    with pytest.raises(SettingsError, match="max_num_seqs"):
        Settings.from_env({"CHATSVC_MAX_NUM_SEQS": "0"})


def test_paths_and_kernels_take_the_configured_dir_not_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATSVC_DATA_DIR", str(tmp_path / "from-env"))
    monkeypatch.setattr(native, "_build_dir", None)
    assert paths.data_root() == Path("~/.cache/chatsvc").expanduser()
    assert native.build_dir() == Path("~/.cache/chatsvc/kernels").expanduser()
    native.set_build_dir(paths.kernels_dir(tmp_path / "configured"))
    assert native.build_dir() == tmp_path / "configured" / "kernels"
    assert paths.data_dir(tmp_path / "configured") == tmp_path / "configured"
    assert not (tmp_path / "from-env").exists()


def test_serve_refuses_a_bad_engine_variable_before_starting_anything(tmp_path, monkeypatch):
    from bench.live_server import free_port
    from chatsvc.__main__ import main

    monkeypatch.setenv("CHATSVC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("CHATSVC_PORT", str(free_port()))
    monkeypatch.setenv("CHATSVC_NUM_GPU_BLOCKS", "many")
    assert main(["serve"]) == 2  # bad settings, not a start-up that failed half way (3)
    assert not (tmp_path / "data").exists()  # no embedded Redis was started
