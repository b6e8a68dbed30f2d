"""First requests after a fresh start: is the service warm when it says it is ready?

    python -m bench.first_requests [--port N] [--requests 10] [--prompt-words 300]
        [--max-tokens 16] [--threads N] [--keep-data]

Starts ``python -m chatsvc serve`` on a new temporary ``CHATSVC_DATA_DIR`` (an
empty embedded Redis, an empty disk KV tier, the kernels built afresh; the
converted default model is reused, as ``bench.multiturn`` does, so a start does
not re-convert the GGUF), and records the wall time from the spawn until
``/healthz`` answers and until ``/readyz`` answers 200. Then it sends
``--requests`` streaming chat completions one after another, each of the same
shape (a system message of ``--prompt-words`` words, about one token each, and a
short question; greedy, ``--max-tokens``), each different from its first word on
so none finds another's prefix in the cache (the rendered prompts share only
``<|im_start|>system``, under one block). Prints every request's TTFT (to the
first content delta) with its prompt and cached tokens, the first request's TTFT
over the last one's against issue 31's 1.3x target ("ready means warm"), and how
long the service took to stop on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.live_server import REPO, free_port, wait_until
from bench.multiturn.client import RequestRecord, stream_chat
from bench.multiturn.words import WORDS
from chatsvc.store.embedded import die_with_parent

TARGET = 1.3  # the first request's TTFT over the last one's, at most (issue 31)


def prompt_messages(index: int, words: int) -> list[dict]:
    """Request ``index``'s messages: ``words`` words of its own, starting with a word no
    other index below ``len(WORDS)`` starts with, so no two share a cacheable prefix."""
    rng = random.Random(index)
    body = [WORDS[index % len(WORDS)], *rng.choices(WORDS, k=words - 1)]
    return [
        {"role": "system", "content": " ".join(body)},
        {"role": "user", "content": f"Summarise note {index} in one line."},
    ]


def service_env(data_dir: Path, port: int, threads: int | None) -> dict[str, str]:
    from chatsvc.engine.weights_gguf import ensure_default_model

    env = dict(os.environ)
    env.update(
        CHATSVC_DATA_DIR=str(data_dir),
        # Converted once in the default data directory; a fresh start reuses it.
        CHATSVC_MODEL=str(ensure_default_model()),
        CHATSVC_REDIS_URL="",  # empty: the service embeds its own Redis
        CHATSVC_PORT=str(port),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def wait_for(process: subprocess.Popen, url: str, status: int | None, timeout_s: float) -> None:
    """Poll ``url`` until it answers (with ``status``, when given); raise if the service exits."""

    def answered() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"chatsvc exited with {process.returncode} before {url} answered")
        try:
            code = httpx.get(url, timeout=2.0).status_code
        except httpx.HTTPError:
            return False
        return status is None or code == status

    wait_until(answered, timeout_s, url)


async def send_requests(base_url: str, args) -> list[RequestRecord]:
    records = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        for index in range(args.requests):
            record = RequestRecord("ours", f"first-{index}", 0, 0.0, max_tokens=args.max_tokens)
            await stream_chat(http, prompt_messages(index, args.prompt_words), record, model, t0)
            records.append(record)
    return records


def stop(process: subprocess.Popen) -> float:
    """SIGTERM, as a supervisor sends it; seconds until the process is gone."""
    start = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its own session: the embedded Redis too
        process.wait()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=None, help="default: a free one")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--prompt-words", type=int, default=300, help="~1 token each")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--keep-data", action="store_true", help="keep the data dir and log")
    args = parser.parse_args()
    if args.requests < 2:
        parser.error("--requests must be at least 2 (the first against the last)")
    port = args.port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    data_dir = Path(tempfile.mkdtemp(prefix="chatsvc-first-"))
    env = service_env(data_dir / "data", port, args.threads)
    log_path = data_dir / "serve.log"
    with log_path.open("wb") as log:
        start = time.perf_counter()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "chatsvc",
                "serve",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,  # a bench killed by a timeout leaves no service
        )
    try:
        wait_for(process, f"{base_url}/healthz", None, args.ready_timeout)
        health_s = time.perf_counter() - start
        wait_for(process, f"{base_url}/readyz", 200, args.ready_timeout)
        ready_s = time.perf_counter() - start
        records = asyncio.run(send_requests(base_url, args))
    except BaseException:
        print(log_path.read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        stop_s = stop(process) if process.poll() is None else float("nan")
        if not args.keep_data:
            shutil.rmtree(data_dir, ignore_errors=True)

    print(
        f"fresh start (data dir {data_dir}): /healthz after {health_s:.1f}s, "
        f"/readyz 200 after {ready_s:.1f}s"
    )
    print("request  ttft_ms  latency_ms  prompt  cached  completion")
    for index, r in enumerate(records, 1):
        print(
            f"{index:>7}  {r.ttft_s * 1e3:>7.1f}  {r.latency_s * 1e3:>10.1f}  "
            f"{r.prompt_tokens:>6}  {r.cached_tokens or 0:>6}  {r.completion_tokens:>10}"
        )
    first, last = records[0].ttft_s, records[-1].ttft_s
    rest = statistics.median(r.ttft_s for r in records[1:])
    print(
        f"first/last ({len(records)}th) TTFT = {first / last:.2f}x (target <= {TARGET}x): "
        f"{'met' if first / last <= TARGET else 'NOT met'}; "
        f"first / median of the others = {first / rest:.2f}x"
    )
    print(f"stop on SIGTERM took {stop_s:.1f}s (exit status {process.returncode})")
    if args.keep_data:
        print(f"log: {log_path}")


if __name__ == "__main__":
    main()
