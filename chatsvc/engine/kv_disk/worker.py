"""The disk tier's I/O thread: runs jobs off the engine's step loop.

Two queues: loads first (a request waits on them), then the rest in order
(writes, deletes, barriers), so a delete queued after a write of the same
block always runs after it. Writes are bounded by the snapshot buffers the
engine hands out; nothing here ever blocks the submitter. Finished jobs are
collected by the engine thread with ``take_done`` between steps.
"""

from __future__ import annotations

import threading
from collections import deque


class IOWorker:
    """One daemon thread executing ``job.run()``; ``close`` drains and joins it."""

    def __init__(self, name: str = "chatsvc-kv-disk") -> None:
        self._urgent: deque = deque()
        self._ordered: deque = deque()
        self._done: list = []
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = 0
        self.finished = threading.Event()  # set whenever a job completes
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit_urgent(self, job) -> None:
        with self._cond:
            self._urgent.append(job)
            self._cond.notify()

    def submit(self, job) -> None:
        with self._cond:
            self._ordered.append(job)
            self._cond.notify()

    def take_done(self) -> list:
        with self._cond:
            done, self._done = self._done, []
            self.finished.clear()
            return done

    @property
    def num_queued(self) -> int:
        with self._cond:
            return len(self._urgent) + len(self._ordered) + self._busy

    def wait(self, timeout_s: float) -> bool:
        """Wait until some job finished (or ``timeout_s``); True if one did."""
        return self.finished.wait(timeout_s)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._urgent or self._ordered or self._stopping):
                    self._cond.wait()
                if self._urgent:
                    job = self._urgent.popleft()
                elif self._ordered:
                    job = self._ordered.popleft()
                else:
                    return
                self._busy = 1
            try:
                job.run()
            except Exception as exc:  # noqa: BLE001 - a bug in a job must not kill the tier
                job.error = exc
            with self._cond:
                self._busy = 0
                self._done.append(job)
                self.finished.set()
