"""``python -m bench.stateful.regenerate``: what a regenerate and an edit cost next to the turn.

On a fresh ``python -m chatsvc serve``, each of ``--sessions`` conversations (a system
prompt, ``--warm`` earlier turns) then sends, one request at a time:

- ``original``:   a new user message (the turn measured against);
- ``regenerate``: ``regenerate: true``, a new answer to that same message: its prompt is
  the original's, token for token, so only the last, partial block is computed;
- ``edit``:       the user message sent again with other text, from the message before it
  (``parent_message_id``): only the edited message is computed.

Printed: prompt and cached tokens (server usage), TTFT p50 (client, to the first SSE
delta; and the server's own). Each is streamed. ``--smoke``: 2 sessions, 1 warm turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

from bench.multiturn.report import percentile
from bench.multiturn.runner import resolve_model_dir
from bench.multiturn.servers import start_server
from bench.multiturn.workload import make_text

KINDS = ("original", "regenerate", "edit")
JSON = {"Content-Type": "application/json"}


async def _turn(http: httpx.AsyncClient, sid: str, body: dict) -> dict:
    """One streamed turn; the done event's body plus the client's TTFT."""
    start = time.perf_counter()
    ttft = None
    name = None
    data = json.dumps({"stream": True, "temperature": 0} | body).encode()
    async with http.stream("POST", f"/sessions/{sid}/messages", content=data, headers=JSON) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                if name == "delta" and ttft is None:
                    ttft = time.perf_counter() - start
                elif name == "done":
                    done = json.loads(line[5:])
                    done["client_ttft_s"] = ttft
                    return done
                elif name == "error":
                    raise RuntimeError(line[5:300])
    raise RuntimeError("the stream ended without a done event")


async def run(
    base_url: str,
    sessions: int,
    warm: int,
    answer_tokens: int,
    seed: int,
    headers: dict[str, str] | None = None,
) -> dict[str, list[dict]]:
    """The done events (plus ``client_ttft_s``) of each kind of turn, per session."""
    rng = random.Random(seed)
    results: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600.0) as http:
        for n in range(sessions):
            system = f"[{n}] " + make_text(rng, 200)
            created = await http.post("/sessions", json={"system_prompt": system})
            sid = created.json()["id"]
            budget = {"max_tokens": answer_tokens}
            for _ in range(warm):
                await _turn(http, sid, {"content": make_text(rng, 32)} | budget)
            results["original"].append(
                await _turn(http, sid, {"content": make_text(rng, 32)} | budget)
            )
            results["regenerate"].append(
                await _turn(http, sid, {"regenerate": True, "temperature": 1.0, "seed": n} | budget)
            )
            messages = (await http.get(f"/sessions/{sid}/messages")).json()["messages"]
            before_user = messages[-2]["parent_id"]
            edit = {"content": make_text(rng, 32), "parent_message_id": before_user} | budget
            results["edit"].append(await _turn(http, sid, edit))
    return results


def summary(results: dict[str, list[dict]]) -> str:
    lines = [
        "| turn | prompt tokens | cached tokens | computed | TTFT p50 client (ms) "
        "| TTFT p50 server (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for kind, rows in results.items():
        prompt = sum(r["usage"]["prompt_tokens"] for r in rows) / len(rows)
        cached = sum(r["usage"]["cached_tokens"] for r in rows) / len(rows)
        client = percentile([r["client_ttft_s"] for r in rows if r["client_ttft_s"]], 50)
        server = percentile([r["timings"]["ttft_s"] for r in rows], 50)
        lines.append(
            f"| {kind} | {prompt:.0f} | {cached:.0f} | {prompt - cached:.0f} | "
            f"{1000 * client:.0f} | {1000 * server:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stateful.regenerate", description=__doc__)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--warm", type=int, default=3, help="turns before the measured one")
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--url", help="drive this running server instead of starting one")
    p.add_argument("--api-key", help="Bearer key for --url")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--smoke", action="store_true", help="2 sessions, 1 warm turn, 4 tokens")
    args = p.parse_args(argv)
    if args.smoke:
        args.sessions, args.warm, args.answer_tokens = 2, 1, 4
    out = Path(args.out)
    figures = (args.sessions, args.warm, args.answer_tokens, args.seed)
    if args.url:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
        results = asyncio.run(run(args.url, *figures, headers=headers))
    else:
        model_dir = resolve_model_dir(args.model_dir)
        with start_server("ours", model_dir, out / "logs", threads=args.threads) as server:
            results = asyncio.run(run(server.base_url, *figures))
    table = summary(results)
    print(f"{args.sessions} sessions, {args.warm} warm turns, {args.answer_tokens} tokens\n")
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"regenerate-{stamp}.json").write_text(json.dumps(results))
    (out / f"regenerate-{stamp}.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
