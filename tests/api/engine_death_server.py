"""``python -m chatsvc serve`` with one injected fault, for tests/api/test_api_engine_death.py.

A request whose stop strings include ``KILL_STOP`` makes ``LLMEngine.step`` raise
what no request owns (as a bug in the scheduler would), so the engine thread dies.
Run as ``python -m tests.api.engine_death_server serve ...`` from the repository root.
"""

from __future__ import annotations

import sys

from chatsvc.__main__ import main
from chatsvc.engine.engine import LLMEngine

KILL_STOP = "<kill-the-engine-thread>"


def _install() -> None:
    real_step = LLMEngine.step

    def step(self):
        if any(KILL_STOP in s.request.sampling.stop for s in self._requests.values()):
            raise RuntimeError("injected: a bug in the engine loop")
        return real_step(self)

    LLMEngine.step = step


if __name__ == "__main__":
    _install()
    sys.exit(main())
