"""The disk tier's I/O threads: run jobs off the engine's step loop.

Three queues: loads (a request waits on them), the rest in order (writes,
deletes, barriers), and background work (the preload after a restart, which no
request waits on). One thread takes loads first, then the ordered jobs one
at a time, so a delete queued after a write of the same block always runs
after it; ``num_loaders - 1`` more threads take only loads, so a burst of
returning sessions reads several blocks at once (the reads, the checksum and
the copy release the GIL). Every thread takes background work only when it
has nothing else, and a background job looks at ``has_urgent`` between blocks
to give way to a request's loads. Loads need no order among themselves: each one
fills its own pool block and reports its own index. Writes are bounded by the
snapshot buffers the engine hands out; nothing here ever blocks the
submitter. Finished jobs are collected by the engine thread with
``take_done`` between steps.

``finished`` wakes a waiting engine once per job, except for loads: those of
one sequence share a ``LoadGroup`` and wake it once, when the last one lands.
An engine with nothing to compute would otherwise run a step per block read,
and each such step holds the GIL the load threads need between their system
calls (docs/cache.md, "Never blocking").
"""

from __future__ import annotations

import threading
from collections import deque


class IOWorker:
    """Daemon threads executing ``job.run()``; ``close`` drains and joins them."""

    def __init__(self, name: str = "chatsvc-kv-disk", num_loaders: int = 1) -> None:
        if num_loaders < 1:
            raise ValueError(f"num_loaders must be >= 1, got {num_loaders}")
        self._urgent: deque = deque()
        self._ordered: deque = deque()
        self._background: deque = deque()
        self._done: list = []
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = 0
        self.finished = threading.Event()  # set when a job completes (see the docstring)
        self._threads = [threading.Thread(target=self._run, args=(True,), name=name, daemon=True)]
        self._threads += [
            threading.Thread(target=self._run, args=(False,), name=f"{name}-load{i}", daemon=True)
            for i in range(1, num_loaders)
        ]
        for thread in self._threads:
            thread.start()

    def submit_urgent(self, job) -> None:
        with self._cond:
            self._urgent.append(job)
            self._cond.notify_all()

    def submit(self, job) -> None:
        with self._cond:
            self._ordered.append(job)
            self._cond.notify_all()

    def submit_background(self, job) -> None:
        with self._cond:
            self._background.append(job)
            self._cond.notify_all()

    @property
    def has_urgent(self) -> bool:
        """A request's load is queued (a background job gives way between its blocks)."""
        return bool(self._urgent)

    def take_done(self) -> list:
        with self._cond:
            done, self._done = self._done, []
            self.finished.clear()
            return done

    @property
    def num_queued(self) -> int:
        with self._cond:
            return len(self._urgent) + len(self._ordered) + len(self._background) + self._busy

    def wait(self, timeout_s: float) -> bool:
        """Wait until some job finished (or ``timeout_s``); True if one did."""
        return self.finished.wait(timeout_s)

    def close(self) -> None:
        """Run what is queued, but background work, then stop the threads."""
        with self._cond:
            self._stopping = True
            self._background.clear()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def _next(self, ordered: bool):
        """The thread's next job, or None once stopping with nothing left for it."""
        with self._cond:
            while True:
                if self._urgent:
                    job = self._urgent.popleft()
                    break
                if ordered and self._ordered:
                    job = self._ordered.popleft()
                    break
                if self._background and not self._stopping:
                    job = self._background.popleft()
                    break
                if self._stopping:
                    return None
                self._cond.wait()
            self._busy += 1
            return job

    def _run(self, ordered: bool) -> None:
        while (job := self._next(ordered)) is not None:
            try:
                job.run()
            except Exception as exc:  # noqa: BLE001 - a bug in a job must not kill the tier
                job.error = exc
            with self._cond:
                self._busy -= 1
                self._done.append(job)
                group = getattr(job, "group", None)
                if group is not None:
                    group.remaining -= 1
                if group is None or group.remaining == 0:
                    self.finished.set()
