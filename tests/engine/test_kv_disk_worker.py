"""The disk tier's I/O threads: loads in parallel, everything else in order on one thread."""

from __future__ import annotations

import threading

import pytest

from chatsvc.engine.kv_disk.jobs import BarrierJob
from chatsvc.engine.kv_disk.load_job import LoadGroup
from chatsvc.engine.kv_disk.worker import IOWorker


class _Rendezvous:
    """A load that only finishes if ``parties`` of them run at the same time."""

    kind = "load"

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier
        self.error = None
        self.thread = None

    def run(self) -> None:
        self.thread = threading.current_thread().name
        self.barrier.wait()  # raises BrokenBarrierError after the barrier's timeout


class _Record:
    """An ordered job that notes where and in which order it ran."""

    kind = "delete"

    def __init__(self, log: list, index: int) -> None:
        self.log = log
        self.index = index
        self.error = None

    def run(self) -> None:
        self.log.append((self.index, threading.current_thread().name))


def _drain(worker: IOWorker, count: int) -> list:
    done: list = []
    while len(done) < count:
        assert worker.wait(10.0), "a job never finished"
        done += worker.take_done()
    return done


def _rendezvous(num_loaders: int, parties: int, timeout_s: float) -> list[_Rendezvous]:
    """``parties`` loads that each wait for all the others, run on ``num_loaders`` threads."""
    worker = IOWorker("t", num_loaders=num_loaders)
    try:
        barrier = threading.Barrier(parties, timeout=timeout_s)
        jobs = [_Rendezvous(barrier) for _ in range(parties)]
        for job in jobs:
            worker.submit_urgent(job)
        _drain(worker, parties)
    finally:
        worker.close()
    return jobs


def test_loads_run_on_several_threads_at_once():
    jobs = _rendezvous(num_loaders=3, parties=3, timeout_s=10.0)
    assert [job.error for job in jobs] == [None, None, None]
    assert len({job.thread for job in jobs}) == 3


def test_one_loader_reads_one_block_at_a_time():
    jobs = _rendezvous(num_loaders=1, parties=2, timeout_s=0.3)
    assert all(isinstance(job.error, threading.BrokenBarrierError) for job in jobs)


def test_ordered_jobs_keep_their_order_on_one_thread_while_loads_run_beside_them():
    worker = IOWorker("t", num_loaders=4)
    log: list = []
    try:
        for i in range(200):
            worker.submit(_Record(log, i))
            if i % 10 == 0:
                worker.submit_urgent(_Record([], -1))
        barrier = BarrierJob()
        worker.submit(barrier)
        barrier.future.result(timeout=10.0)
        # Everything queued before the barrier in the ordered queue has run.
        assert [index for index, _ in log] == list(range(200))
        assert len({thread for _, thread in log}) == 1
    finally:
        worker.close()


def test_close_runs_what_is_queued_and_stops_every_thread():
    worker = IOWorker("t", num_loaders=3)
    log: list = []
    for i in range(50):
        worker.submit_urgent(_Record(log, i))
        worker.submit(_Record(log, 100 + i))
    worker.close()
    assert sorted(index for index, _ in log) == [*range(50), *range(100, 150)]
    assert worker.num_queued == 0
    assert not any(thread.is_alive() for thread in worker._threads)  # noqa: SLF001


def test_a_failing_job_is_reported_and_the_threads_go_on():
    class Broken:
        kind = "load"
        error = None

        def run(self):
            raise RuntimeError("bug")

    worker = IOWorker("t", num_loaders=2)
    log: list = []
    try:
        worker.submit_urgent(Broken())
        worker.submit_urgent(Broken())
        worker.submit(_Record(log, 0))
        done = _drain(worker, 3)
    finally:
        worker.close()
    assert sorted(type(job.error).__name__ for job in done) == ["NoneType", *["RuntimeError"] * 2]
    assert log and log[0][0] == 0


def test_at_least_one_thread():
    with pytest.raises(ValueError, match="num_loaders"):
        IOWorker("t", num_loaders=0)


class _Gated:
    """A load that runs until its gate opens; ``group`` as the tier sets it."""

    kind = "load"

    def __init__(self, group=None) -> None:
        self.gate = threading.Event()
        self.group = group
        self.error = None

    def run(self) -> None:
        assert self.gate.wait(10.0)


def test_the_loads_of_one_sequence_wake_the_engine_once_when_the_last_lands():
    worker = IOWorker("t", num_loaders=2)
    try:
        group = LoadGroup(2)
        first, second = _Gated(group), _Gated(group)
        worker.submit_urgent(first)
        worker.submit_urgent(second)
        first.gate.set()
        while worker.num_queued > 1:
            threading.Event().wait(0.01)
        assert not worker.finished.is_set()  # one of two landed: nothing to do yet
        assert [job is first for job in worker.take_done()] == [True]
        second.gate.set()
        assert worker.wait(10.0)
        assert worker.take_done() == [second]
    finally:
        worker.close()


class _Gate:
    """A job that runs until released, noting that it started."""

    kind = "load"

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.error = None

    def run(self) -> None:
        self.started.set()
        assert self.release.wait(10.0)


def test_background_work_runs_only_when_nothing_else_waits_and_close_drops_it():
    worker = IOWorker("t", num_loaders=1)
    log: list = []
    gate = _Gate()
    try:
        worker.submit_urgent(gate)
        assert gate.started.wait(10.0)
        # Queued while the one thread is busy: the background job goes after the others.
        worker.submit_background(_Record(log, "background"))
        worker.submit(_Record(log, "ordered"))
        worker.submit_urgent(_Record(log, "load"))
        assert worker.has_urgent
        gate.release.set()
        _drain(worker, 4)
        assert [index for index, _ in log] == ["load", "ordered", "background"]
        assert not worker.has_urgent

        gate = _Gate()
        worker.submit_urgent(gate)
        assert gate.started.wait(10.0)
        worker.submit_background(_Record(log, "never"))
        closing = threading.Thread(target=worker.close)
        closing.start()
        while worker.num_queued > 1:  # close() drops the background job, then joins
            closing.join(0.01)
        gate.release.set()
        closing.join(10.0)
        assert not closing.is_alive()
    finally:
        gate.release.set()
        worker.close()
    assert "never" not in [index for index, _ in log]
