"""The engine's watchdog: ends an engine that holds requests and makes no progress.

A step that never returns (a kernel's threads waiting on each other, a read that
never ends) or a loop that steps without ever computing (a scheduling bug) would
hold every request in flight, and their sessions' turn locks, for as long as the
process lives, with nothing in the log: the event loop stays alive and renews the
locks. The engine thread tells its ``Watchdog`` each time it makes progress (a step
that moved a request: computed tokens, started or landed a load, failed or
preempted one; a command applied; a pass with no request at all). A thread of the
watchdog's own looks a few times per ``timeout_s``; once that long has passed
without progress it logs every thread's stack and the scheduler's queues, and
calls ``on_stall``: the AsyncEngine then fails every waiter and stops as if its
thread had died, so the service exits and its supervisor starts a clean process
(what was acknowledged is in Redis and on disk already).

The warm-up before serving (``pause``) is not watched: it may run for
``warm_up_s``, and no request waits on it.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)

# Looks per timeout: a stall is noticed at most a quarter of the timeout late.
LOOKS_PER_TIMEOUT = 4
MAX_LOOK_S = 1.0
# A look this many intervals late means the whole process was not running in between.
PAUSED_LOOKS = 8


class EngineStalledError(RuntimeError):
    """The engine held requests and made no progress for the watchdog's timeout."""


class Watchdog:
    """Calls ``on_stall(error)`` once when no ``beat`` came for ``timeout_s`` while not paused.

    ``beat``, ``pause`` and ``resume`` are the watched thread's; ``describe`` (a text on
    the engine's queues, for the log) is read from the watchdog's thread while the
    watched one may still change them, so it is best effort.
    """

    def __init__(
        self,
        timeout_s: float,
        on_stall: Callable[[EngineStalledError], None],
        describe: Callable[[], str],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        self._describe = describe
        self._clock = clock
        self._last = clock()
        self._paused = False
        self._done = threading.Event()

    def beat(self) -> None:
        self._last = self._clock()

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._last = self._clock()
        self._paused = False

    def stalled_for(self) -> float:
        """Seconds since the last progress (0 while paused)."""
        return 0.0 if self._paused else self._clock() - self._last

    def start(self, watched: threading.Thread) -> None:
        self.beat()
        threading.Thread(
            target=self._watch, args=(watched,), name="chatsvc-watchdog", daemon=True
        ).start()

    def stop(self) -> None:
        self._done.set()

    def _watch(self, watched: threading.Thread) -> None:
        look_s = min(MAX_LOOK_S, self.timeout_s / LOOKS_PER_TIMEOUT)
        looked = self._clock()
        while not self._done.wait(look_s):
            now, before = self._clock(), looked
            looked = now
            if now - before > PAUSED_LOOKS * look_s:
                # The process (or its machine) did not run for a while: stopped, frozen,
                # a VM paused. Its engine did not either; the count starts again.
                self.beat()
                continue
            stalled = self.stalled_for()
            if stalled < self.timeout_s:
                continue
            error = EngineStalledError(f"the engine made no progress for {stalled:.0f} s")
            log.critical(
                "%s with requests in flight; it is stopped and every waiter fails.\nQueues: %s\n%s",
                error,
                _best_effort(self._describe),
                thread_stacks(first=watched),
            )
            self._on_stall(error)
            return


def thread_stacks(first: threading.Thread | None = None) -> str:
    """Every thread's Python stack, ``first``'s first (a thread in a C call shows the
    Python line that made it)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sys._current_frames()  # noqa: SLF001 - the one way to read another thread's stack
    order = sorted(frames, key=lambda ident: first is None or ident != first.ident)
    return "\n".join(
        f'Thread "{names.get(ident, ident)}":\n' + "".join(traceback.format_stack(frames[ident]))
        for ident in order
    )


def _best_effort(describe: Callable[[], str]) -> str:
    try:
        return describe()
    except Exception as error:  # noqa: BLE001 - the queues changed under the read
        return f"(not read: {type(error).__name__})"
