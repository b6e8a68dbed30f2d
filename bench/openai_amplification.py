"""How big an answer a small completions body buys, and how long it holds the event loop.

Starts ``python -m chatsvc serve`` (the real model, an embedded Redis), sends one
``POST /v1/completions`` of the amplifying shape (token-id prompts, ``n``,
``prompt_logprobs``, ``max_tokens: 1``) and polls ``/healthz`` every 10 ms while it
runs. Prints the body and answer bytes, the request's wall time, and /healthz's
latency (max, p99): a stall of the event loop shows as a /healthz that waits.
``--issue-shape`` also sends the issue's full request (4 x 1,024 ids, n 8,
prompt_logprobs 20: a 45 MB answer where nothing bounds it).

    python -m bench.openai_amplification                 # 2 x 512 ids, n 4, 20 scores
    python -m bench.openai_amplification --issue-shape   # plus the issue's request
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from bench.live_server import ProcessServer
from chatsvc.store.embedded import EmbeddedRedis

API_KEY = "bench-amplification-key-01"
POLL_S = 0.01
FIRST_ID = 300


def _body(prompts: int, prompt_len: int, n: int, prompt_logprobs: int) -> dict:
    ids = [[FIRST_ID + p + i for i in range(prompt_len)] for p in range(prompts)]
    return {
        "model": "any",
        "prompt": ids,
        "n": n,
        "prompt_logprobs": prompt_logprobs,
        "max_tokens": 1,
        "temperature": 1.0,
    }


async def _poll(client: httpx.AsyncClient, done: asyncio.Event, latencies: list[float]) -> None:
    while not done.is_set():
        started = time.perf_counter()
        await client.get("/healthz")
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(POLL_S)


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def _measure(url: str, label: str, body: dict) -> dict:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with (
        httpx.AsyncClient(base_url=url, headers=headers, timeout=900) as client,
        httpx.AsyncClient(base_url=url, timeout=900) as health,
    ):
        models = (await client.get("/v1/models")).json()
        body = {**body, "model": models["data"][0]["id"]}
        raw = json.dumps(body).encode()
        done, latencies = asyncio.Event(), []
        poller = asyncio.create_task(_poll(health, done, latencies))
        started = time.perf_counter()
        response = await client.post(
            "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
        )
        wall = time.perf_counter() - started
        done.set()
        await poller
    figures = {
        "request": label,
        "status": response.status_code,
        "body_bytes": len(raw),
        "answer_bytes": len(response.content),
        "amplification": round(len(response.content) / len(raw), 1),
        "wall_s": round(wall, 2),
        "healthz_polls": len(latencies),
        "healthz_max_ms": round(max(latencies) * 1000, 1),
        "healthz_p99_ms": round(_p99(latencies) * 1000, 1),
    }
    if response.status_code != 200:
        figures["error"] = response.json()["error"]["message"][:120]
    return figures


async def run(args: argparse.Namespace, work_dir: Path) -> list[dict]:
    shapes = [
        (
            f"{args.prompts} x {args.prompt_len} ids, n {args.n}, "
            f"prompt_logprobs {args.prompt_logprobs}",
            _body(args.prompts, args.prompt_len, args.n, args.prompt_logprobs),
        )
    ]
    if args.issue_shape:
        shapes.append(("issue: 4 x 1024 ids, n 8, prompt_logprobs 20", _body(4, 1024, 8, 20)))
    with EmbeddedRedis(work_dir / "redis", appendfsync="everysec") as redis_server:
        env = {
            "CHATSVC_REDIS_URL": redis_server.url,
            "CHATSVC_API_KEYS": f"bench:{API_KEY}",
            "CHATSVC_MAX_MODEL_LEN": "2048",
            "CHATSVC_MAX_BODY_BYTES": "4000000",
        }
        server = ProcessServer(env, work_dir / "chatsvc.log")
        await asyncio.to_thread(server.start)
        try:
            return [await _measure(server.url, label, body) for label, body in shapes]
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-logprobs", type=int, default=20)
    parser.add_argument("--issue-shape", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="amplification-") as tmp:
        for figures in asyncio.run(run(args, Path(tmp))):
            print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
