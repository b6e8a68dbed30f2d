"""``python -m chatsvc serve`` with injected faults, for tests/api/test_api_engine_death.py.

A request whose stop strings include ``KILL_STOP`` makes ``LLMEngine.step`` raise
what no request owns (as a bug in the scheduler would), so the engine thread dies;
one with ``HANG_STOP`` makes the step never return (as threads waiting on each
other in a kernel would), so the engine's watchdog stops it.
Run as ``python -m tests.api.engine_death_server serve ...`` from the repository root.
"""

from __future__ import annotations

import sys
import threading

from chatsvc.__main__ import main
from chatsvc.engine.engine import LLMEngine

KILL_STOP = "<kill-the-engine-thread>"
HANG_STOP = "<hang-the-engine-thread>"


def _install() -> None:
    real_step = LLMEngine.step

    def step(self):
        stops = [s.request.sampling.stop for s in self._requests.values()]
        if any(KILL_STOP in stop for stop in stops):
            raise RuntimeError("injected: a bug in the engine loop")
        if any(HANG_STOP in stop for stop in stops):
            threading.Event().wait()  # for good: the process's exit ends it
        return real_step(self)

    LLMEngine.step = step


if __name__ == "__main__":
    _install()
    sys.exit(main())
