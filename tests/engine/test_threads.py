"""Serving thread count: config first, then OMP_NUM_THREADS, then one per core."""

import os

import pytest
import torch

from chatsvc.engine.config import EngineConfig
from chatsvc.engine.threads import set_torch_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_config_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert set_torch_threads(1) == 1


def test_omp_num_threads_is_left_alone(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    assert set_torch_threads(None) == 1


def test_default_is_one_per_core(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(1)
    assert set_torch_threads(None) == os.cpu_count()


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="num_threads"):
        set_torch_threads(0)
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=0).validate()
    assert EngineConfig.from_env({"CHATSVC_NUM_THREADS": "3"}).num_threads == 3
