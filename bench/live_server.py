"""Run the real app under uvicorn on a free loopback port, in-process or as a child process.

Shared by the benchmarks (bench/reliability, bench/multiturn) and the test suites.

In-process (``ThreadServer``): the app's event loop runs in a thread, so tests
can call real HTTP clients (httpx, the openai SDK) and still reach the live
Services object through ``call`` (run a coroutine on the server's loop).
Child process (``ProcessServer``): ``python -m chatsvc serve``, for the tests
that kill the service and start it again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from chatsvc.api.http_server import uvicorn_config

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unique_prefix(label: str = "t") -> str:
    """A Redis key prefix nobody else uses: servers (and tests) sharing one Redis keep apart."""
    return f"{label}-{uuid.uuid4().hex[:12]}"


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until it holds; a readiness wait, not a speed assertion."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout_s:.0f} s")
        time.sleep(0.05)


class ThreadServer:
    """uvicorn serving ``app`` in a background thread; use as a context manager."""

    def __init__(self, app: Any, startup_timeout_s: float = 300.0) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(app, "127.0.0.1", self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="uvicorn", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.startup_timeout_s = startup_timeout_s

    def _run(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve()

        asyncio.run(serve())

    def __enter__(self) -> ThreadServer:
        """Start it; returns once it serves (its engine loaded and warmed up)."""
        self.thread.start()
        wait_until(
            lambda: self._serving() or not self.thread.is_alive(),
            self.startup_timeout_s,
            "the API server to start",
        )
        if not self._serving():
            raise RuntimeError("the API server failed to start (see the log above)")
        return self

    def _serving(self) -> bool:
        # uvicorn starts serving (the probes) before the engine is up (chatsvc/service.py).
        if not self.server.started:
            return False
        services = getattr(self.app.state, "services", None)
        if services is None or not hasattr(services, "engine_started"):
            return True  # an app without chatsvc's services
        if services.start_failure is not None:
            self.server.should_exit = True
            raise RuntimeError(f"the engine failed to start: {services.start_failure!r}")
        return services.engine_started

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)

    @property
    def services(self) -> Any:
        return self.app.state.services

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        """Run ``coro`` on the server's event loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


class ProcessServer:
    """``python -m chatsvc serve`` as a child process with the given CHATSVC_* variables.

    ``module``: run ``python -m <module> serve`` instead (a wrapper that injects a fault).
    """

    def __init__(self, env: dict[str, str], log_path: Path, module: str = "chatsvc") -> None:
        self.module = module
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The disk KV tier (on by default) keeps its files beside the log, not in the
        # user's data directory, unless the caller names a directory of its own.
        kv_dir = {"CHATSVC_KV_DISK_DIR": str(log_path.parent / "kv")}
        self.env = {**os.environ, **kv_dir, **env, "CHATSVC_PORT": str(self.port)}
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 300.0) -> ProcessServer:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module, "serve", "--log-level", "warning"],
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"chatsvc exited early:\n{self.log_tail(3000)}")
            try:
                return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout_s, "chatsvc serve to become ready")
        return self

    def log_tail(self, chars: int = 20_000) -> str:
        """The end of the service's log (for a failure's message: a stalled engine's
        stacks are there)."""
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL: no shutdown hooks run, as in a crash."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
