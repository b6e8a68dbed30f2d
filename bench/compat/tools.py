"""What the compatibility runs share: the tools' environments and our server under test."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from bench.multiturn.servers import RunningServer, start_server

REPO = Path(__file__).resolve().parents[2]
VENVS = REPO / ".chatsvc" / "venvs"
RESULTS = REPO / "bench" / "results"


def tool(env: str, name: str) -> Path:
    """A command of one of the tools' environments; made by ``bench/compat/envs.sh`` if missing."""
    path = VENVS / env / "bin" / name
    if not path.exists():
        print(f"creating the {env} environment (bench/compat/envs.sh {env}) ...", flush=True)
        subprocess.run([str(REPO / "bench" / "compat" / "envs.sh"), env], check=True)
    return path


def default_model_dir() -> Path:
    from chatsvc.engine.weights_gguf import ensure_default_model

    return ensure_default_model()


def served_model(url: str) -> str:
    """The model a running service at ``url`` serves (its /v1/models)."""
    from bench.multiturn.servers import served_model as listed

    return listed(url, {})


def offline_env() -> dict[str, str]:
    """The tools' environment: nothing may reach a model hub."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


@contextmanager
def our_server(model_dir: Path, log_dir: Path, **settings: str):
    """``python -m chatsvc serve`` on a free port with an embedded Redis in a temporary
    directory; ``settings`` are CHATSVC_* variables (``dtype="fp32"`` -> CHATSVC_DTYPE)."""
    saved = {}
    for key, value in settings.items():
        name = f"CHATSVC_{key.upper()}"
        saved[name] = os.environ.get(name)
        os.environ[name] = value
    try:
        server: RunningServer = start_server("ours", model_dir, log_dir)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    with server:
        yield server


def run(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
    """Run a tool, its output teed to ``log_path``; raises CalledProcessError on failure."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print("$", " ".join(argv), flush=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env or offline_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
        if process.wait() != 0:
            raise subprocess.CalledProcessError(process.returncode, argv)
