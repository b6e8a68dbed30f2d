"""Serving thread count: config first, then OMP_NUM_THREADS, then one per usable CPU;
and the governor that takes threads off while other processes use the cores."""

import os
import subprocess
import sys
import time

import pytest
import torch

from chatsvc.engine.config import EngineConfig
from chatsvc.engine.threads import (
    WINDOW_S,
    ThreadGovernor,
    cpu_seconds,
    governor_for,
    set_torch_threads,
    usable_cpus,
)


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


def test_default_is_one_per_usable_cpu(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(1)
    assert set_torch_threads(None) == usable_cpus() <= len(os.sched_getaffinity(0))


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="num_threads"):
        set_torch_threads(0)
    with pytest.raises(ValueError, match="num_threads"):
        EngineConfig(num_threads=0).validate()
    assert EngineConfig.from_env({"CHATSVC_NUM_THREADS": "3"}).num_threads == 3


def test_a_cgroup_quota_below_the_cpus_bounds_the_count(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs' worth
    assert usable_cpus(tmp_path) == min(cpus, 2)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == cpus
    assert usable_cpus(tmp_path / "none") == cpus


class Usage:
    """What /proc would say: busy seconds of the CPUs and ours, advanced by hand."""

    def __init__(self) -> None:
        self.now, self.busy, self.ours, self.reads = 0.0, 0.0, 0.0, 0

    def pass_time(self, seconds: float, ours_cores: float, others_cores: float) -> None:
        self.now += seconds
        self.ours += seconds * ours_cores
        self.busy += seconds * (ours_cores + others_cores)

    def read(self, cpus):
        self.reads += 1
        return self.busy, self.ours


def _governor(usage: Usage, applied: list[int], most: int = 2) -> ThreadGovernor:
    return ThreadGovernor(
        most, frozenset(range(most)), read=usage.read, clock=lambda: usage.now, apply=applied.append
    )


def test_the_team_gives_up_a_thread_while_another_process_uses_a_core_and_takes_it_back():
    usage, applied = Usage(), []
    governor = _governor(usage, applied)
    usage.pass_time(WINDOW_S, ours_cores=2.0, others_cores=0.0)  # the machine to itself
    assert governor.before_step() == 2 and applied == []
    usage.pass_time(WINDOW_S, ours_cores=1.0, others_cores=1.0)  # a build beside it
    assert governor.before_step() == 1 and applied == [1]
    usage.pass_time(WINDOW_S, ours_cores=1.0, others_cores=0.9)  # with one thread it stays
    assert governor.before_step() == 1 and applied == [1]
    usage.pass_time(WINDOW_S, ours_cores=1.2, others_cores=0.3)  # a light client: not a core
    assert governor.before_step() == 2 and applied == [1, 2]


def test_the_team_never_drops_below_one_and_looks_once_a_window():
    usage, applied = Usage(), []
    governor = _governor(usage, applied, most=4)
    usage.pass_time(WINDOW_S / 4, ours_cores=1.0, others_cores=8.0)
    assert governor.before_step() == 4 and usage.reads == 1  # inside the window: no look
    usage.pass_time(WINDOW_S, ours_cores=1.0, others_cores=8.0)
    assert governor.before_step() == 1 and usage.reads == 2
    usage.pass_time(WINDOW_S, ours_cores=3.0, others_cores=1.6)  # two cores' worth taken
    assert governor.before_step() == 2 and applied == [1, 2]


def test_a_window_spanning_a_start_up_decides_nothing_and_idle_looks_keep_it_fresh():
    """A compiler building the kernels while the model loads is long gone when the first
    request comes: a window that old only starts the next one (it was 1.8x the tenth
    request's TTFT, the first request on one thread, bench.first_requests)."""
    usage, applied = Usage(), []
    governor = _governor(usage, applied)
    usage.pass_time(10.0, ours_cores=1.0, others_cores=0.7)  # load + the kernels' build
    assert governor.before_step() == 2 and applied == []
    usage.pass_time(WINDOW_S, ours_cores=2.0, others_cores=0.0)
    assert governor.before_step() == 2 and applied == []
    # Idle looks every window follow a neighbour that starts and stops while no step runs.
    usage.pass_time(WINDOW_S, ours_cores=0.0, others_cores=1.0)
    assert governor.before_step() == 1 and applied == [1]
    usage.pass_time(WINDOW_S, ours_cores=0.0, others_cores=0.0)
    assert governor.before_step() == 2 and applied == [1, 2]


def test_a_fixed_count_has_no_governor(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert governor_for(None) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert governor_for(1) is None
    torch.set_num_threads(1)
    assert governor_for(None) is None  # one thread: nothing to give up


def test_a_busy_process_in_another_session_takes_a_thread_off_the_real_team():
    # The real /proc: a busy loop started as from another terminal (a session of its
    # own, so nice or not it gets a fair share of a core) while this test sleeps.
    cpus = frozenset(os.sched_getaffinity(0))
    before = cpu_seconds(cpus)
    assert before is not None and before[0] >= before[1] >= 0
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(0.3)
        applied: list[int] = []
        governor = ThreadGovernor(len(cpus), cpus, apply=applied.append)
        time.sleep(WINDOW_S + 0.5)
        assert governor.before_step() < len(cpus) or len(cpus) == 1, applied
    finally:
        loop.kill()
        loop.wait()
