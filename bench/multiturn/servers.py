"""Start and stop the systems under test on loopback, each as its own process group.

- ``ours``          ``python -m chatsvc serve`` with its prefix cache on (embedded Redis in
                    a temporary data directory)
- ``ours-nocache``  the same with ``CHATSVC_ENABLE_PREFIX_CACHE=0``
- ``hf``            ``transformers serve <model dir>``
- ``hf-cb``         ``transformers serve <model dir> --continuous-batching``
- ``llama``         llama.cpp's ``llama-server`` (``$LLAMA_SERVER``, else on ``PATH``; it
                    is not installed by the project: ``bench/llama_server.sh`` builds one)
                    on the GGUF the default model is converted from (SmolLM2-135M-Instruct,
                    Q4_1), 8 slots, its prompt cache on

The transformers peers read the same local safetensors directory as ours, offline. A
server pinned to a model (``transformers serve <dir>``) accepts requests that name that
directory, or none.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.live_server import free_port
from chatsvc.store.embedded import die_with_parent

SYSTEMS = ("ours", "ours-nocache", "hf", "hf-cb", "llama")
LLAMA_SLOTS = 8  # parallel sequences of llama-server: the benchmark's default concurrency


class ServerStartError(RuntimeError):
    """The server exited or did not become ready in time; the message ends with its log."""


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    ready_path: str
    model: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    admin_cache_path: str | None = None
    # A temporary directory the server owns (embedded Redis); removed after stop.
    data_dir: Path | None = None


def _venv_bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def build_spec(
    system: str, model_dir: Path, port: int, data_dir: Path, threads: int | None = None
) -> ServerSpec:
    """The command line and environment of ``system``. Raises ValueError for an unknown name."""
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # Every system gets the same intra-op threads: torch's default (one per core) unless
    # --threads says otherwise. On a quiet 2-core machine the peers run faster with two
    # than with one (docs/benchmarks.md); on a machine busy with other jobs one thread
    # each is the fairer setting.
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    host = ("--host", "127.0.0.1", "--port", str(port))
    if system in ("ours", "ours-nocache"):
        env["CHATSVC_MODEL"] = str(model_dir)
        env["CHATSVC_DATA_DIR"] = str(data_dir)
        env["CHATSVC_REDIS_URL"] = ""
        env["CHATSVC_ENABLE_PREFIX_CACHE"] = "1" if system == "ours" else "0"
        # The peers limit no tenant's request rate, and the load comes from one client.
        env["CHATSVC_TENANT_REQUESTS_PER_S"] = "0"
        return ServerSpec(
            system,
            (sys.executable, "-m", "chatsvc", "serve", *host),
            env,
            ready_path="/readyz",
            admin_cache_path="/admin/cache",
            data_dir=data_dir,
        )
    if system in ("hf", "hf-cb"):
        argv = [_venv_bin("transformers"), "serve", str(model_dir), *host, "--device", "cpu"]
        if system == "hf-cb":
            argv.append("--continuous-batching")
        return ServerSpec(system, tuple(argv), env, ready_path="/health", model=str(model_dir))
    if system == "llama":
        from chatsvc.engine.weights_gguf import default_gguf_path

        binary = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server") or "llama-server"
        argv = [binary, "-m", str(default_gguf_path()), *host, "-np", str(LLAMA_SLOTS)]
        argv += ["-c", str(LLAMA_SLOTS * 2048), "--jinja"]
        if threads is not None:
            argv += ["-t", str(threads)]
        return ServerSpec(system, tuple(argv), env, ready_path="/health")
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


class RunningServer:
    """A started server process. Use as a context manager; ``stop`` is idempotent."""

    def __init__(self, spec: ServerSpec, port: int, log_path: Path) -> None:
        self.spec = spec
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.model = spec.model
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        # A session of its own: stop() signals the whole group (uvicorn workers, redis).
        self.process = subprocess.Popen(
            spec.argv,
            env=spec.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # A killed bench leaves no server. Linux signals it when the *thread* that
            # started it exits: the CLIs start their servers from their main threads.
            preexec_fn=die_with_parent,
        )

    def wait_ready(self, timeout_s: float) -> float:
        """Poll the readiness path until it answers 200; returns seconds waited."""
        start = time.perf_counter()
        while time.perf_counter() - start < timeout_s:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"{self.spec.name} exited with {self.process.returncode}\n{self.log_tail()}"
                )
            try:
                response = httpx.get(self.base_url + self.spec.ready_path, timeout=2.0)
                if response.status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerStartError(f"{self.spec.name} not ready in {timeout_s:.0f}s\n{self.log_tail()}")

    def log_tail(self, num_bytes: int = 3000) -> str:
        self._log.flush()
        data = self.log_path.read_bytes()
        return data[-num_bytes:].decode(errors="replace")

    def stop(self, grace_s: float = 15.0) -> None:
        if self.process.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # Stragglers of the group (an embedded Redis whose parent was killed) go too.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not self._log.closed:
            self._log.close()
        if self.spec.data_dir is not None and self.process.poll() is not None:
            shutil.rmtree(self.spec.data_dir, ignore_errors=True)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    system: str,
    model_dir: Path,
    log_dir: Path,
    ready_timeout_s: float = 300.0,
    threads: int | None = None,
) -> RunningServer:
    """Start ``system`` on a free loopback port and wait until it is ready."""
    port = free_port()
    data_dir = Path(tempfile.mkdtemp(prefix=f"bench-{system}-"))
    spec = build_spec(system, model_dir, port, data_dir, threads)
    if spec.data_dir is None:
        shutil.rmtree(data_dir, ignore_errors=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    server = RunningServer(spec, port, log_dir / f"{system}.log")
    try:
        server.wait_ready(ready_timeout_s)
        if spec.model is None:
            server.model = served_model(server.base_url, spec.headers)
    except BaseException:
        server.stop()
        raise
    return server


def served_model(base_url: str, headers: dict[str, str]) -> str:
    """The id a server lists first in ``GET /v1/models``: the name its requests must use."""
    response = httpx.get(base_url + "/v1/models", headers=headers, timeout=10.0)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ServerStartError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]
