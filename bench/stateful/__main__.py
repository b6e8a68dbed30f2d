"""``python -m bench.stateful``: the multi-turn workload through both OpenAI APIs of ours.

The same conversations (bench/multiturn's seeded workload) run twice, each on a fresh
``python -m chatsvc serve`` (so neither run warms the other's cache):

- ``responses``: ``/v1/responses``, each turn naming the previous one by
  ``previous_response_id`` (the system prompt goes as ``instructions``, every turn);
- ``chat``: ``/v1/chat/completions``, each turn resending the whole history.

Printed per turn: TTFT p50 (client, to the first text), bytes of request body sent,
prompt tokens and the prefix-cache hit rate (cached / prompt tokens, as the server
reports them). ``--smoke``: 2 conversations x 2 turns, a harness check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from bench.multiturn.client import warm_up
from bench.multiturn.report import percentile
from bench.multiturn.runner import resolve_model_dir
from bench.multiturn.servers import served_model, start_server
from bench.multiturn.workload import Distribution, WorkloadConfig, generate_workload
from bench.stateful.clients import TurnFailed, TurnRecord, chat_turn, responses_turn

APIS = ("responses", "chat")


async def _conversation(http, api: str, model: str, conv, records: list, gate) -> None:
    async with gate:
        messages = [{"role": "system", "content": conv.system_prompt}]
        previous = None
        for turn, text in enumerate(conv.user_turns):
            if conv.think_times_s[turn] > 0:
                await asyncio.sleep(conv.think_times_s[turn])
            record = TurnRecord(api, conv.conversation_id, turn, 0)
            records.append(record)
            budget = conv.answer_tokens[turn]
            if api == "chat":
                messages.append({"role": "user", "content": text})
                await chat_turn(http, model, list(messages), record, budget)
                messages.append({"role": "assistant", "content": record.answer})
            else:
                request = {"input": text, "instructions": conv.system_prompt}
                if previous is not None:
                    request["previous_response_id"] = previous
                await responses_turn(http, model, request, record, budget)
                previous = record.response_id


async def run_api(
    api: str,
    base_url: str,
    model: str,
    workload,
    concurrency: int,
    headers: dict[str, str] | None = None,
) -> tuple[list[TurnRecord], float]:
    """Run every conversation of ``workload`` through ``api``; the records and wall time."""
    await warm_up(base_url, model, headers)
    records: list[TurnRecord] = []
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600.0) as http:
        start = time.perf_counter()
        await asyncio.gather(
            *(_conversation(http, api, model, c, records, gate) for c in workload.conversations)
        )
        wall = time.perf_counter() - start
    return records, wall


def per_turn(records: list[TurnRecord]) -> dict[int, dict]:
    """Figures per turn index: TTFT p50, mean bytes sent and prompt tokens, hit rate."""
    table = {}
    for turn in sorted({r.turn for r in records}):
        rows = [r for r in records if r.turn == turn]
        prompt = sum(r.prompt_tokens or 0 for r in rows)
        cached = sum(r.cached_tokens or 0 for r in rows)
        ttfts = [r.ttft_s for r in rows if r.ttft_s is not None]
        table[turn] = {
            "ttft_p50_ms": None if not ttfts else 1000 * percentile(ttfts, 50),
            "bytes_sent": sum(r.bytes_sent for r in rows) / len(rows),
            "prompt_tokens": prompt / len(rows),
            "hit_rate": cached / prompt if prompt else 0.0,
        }
    return table


def markdown(results: dict[str, dict[int, dict]]) -> str:
    head = "| turn | " + " | ".join(
        f"{api} TTFT p50 (ms) | {api} bytes sent | {api} hit rate" for api in results
    )
    lines = [head + " |", "|" + "---|" * (1 + 3 * len(results))]
    turns = sorted(set().union(*(t.keys() for t in results.values())))
    for turn in turns:
        cells = [str(turn + 1)]
        for table in results.values():
            row = table.get(turn)
            if row is None:
                cells += ["–"] * 3
                continue
            ttft = "–" if row["ttft_p50_ms"] is None else f"{row['ttft_p50_ms']:.0f}"
            cells += [ttft, f"{row['bytes_sent']:.0f}", f"{100 * row['hit_rate']:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.stateful", description=__doc__)
    p.add_argument("--apis", default=",".join(APIS))
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--system-tokens", default="200")
    p.add_argument("--user-tokens", default="uniform:16:48")
    p.add_argument("--answer-tokens", default="uniform:16:48")
    p.add_argument("--think-time", default="uniform:0:1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--url", help="drive this running server instead (both APIs then share its cache)"
    )
    p.add_argument("--api-key", help="Bearer key for --url")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--smoke", action="store_true", help="2 conversations x 2 turns")
    return p


def smoke_config(seed: int = 0) -> WorkloadConfig:
    return WorkloadConfig(
        num_conversations=2,
        num_turns=2,
        num_system_prompts=1,
        system_prompt_tokens=Distribution.parse("40"),
        user_tokens=Distribution.parse("8"),
        answer_tokens=Distribution.parse("4"),
        think_time_s=Distribution.parse("0"),
        seed=seed,
    )


def _run_on_fresh_server(api, args, model_dir, workload, out):
    with start_server("ours", model_dir, out / "logs", threads=args.threads) as server:
        try:
            return asyncio.run(
                run_api(api, server.base_url, server.model, workload, args.concurrency)
            )
        except TurnFailed as exc:
            raise TurnFailed(f"{exc}\n{server.log_tail()}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = (
        smoke_config(args.seed)
        if args.smoke
        else WorkloadConfig(
            num_conversations=args.conversations,
            num_turns=args.turns,
            system_prompt_tokens=Distribution.parse(args.system_tokens),
            user_tokens=Distribution.parse(args.user_tokens),
            answer_tokens=Distribution.parse(args.answer_tokens),
            think_time_s=Distribution.parse(args.think_time),
            seed=args.seed,
        )
    )
    workload = generate_workload(config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    model_dir = None if args.url else resolve_model_dir(args.model_dir)
    results, raw = {}, {}
    for api in args.apis.split(","):
        if api not in APIS:
            print(f"unknown api {api!r}; known: {', '.join(APIS)}", file=sys.stderr)
            return 2
        try:
            if args.url:
                model = served_model(args.url, headers or {})
                run = run_api(api, args.url, model, workload, args.concurrency, headers)
                records, wall = asyncio.run(run)
            else:
                records, wall = _run_on_fresh_server(api, args, model_dir, workload, out)
        except TurnFailed as exc:
            print(f"{api}: a turn failed: {exc}", file=sys.stderr)
            return 1
        results[api] = per_turn(records)
        raw[api] = {"wall_s": wall, "records": [asdict(r) for r in records]}
        print(f"{api}: {len(records)} turns in {wall:.1f} s")
    table = markdown(results)
    print(f"\n{workload.description}\n\n{table}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"stateful-{stamp}.md").write_text(f"{workload.description}\n\n{table}\n")
    path = out / f"stateful-{stamp}.json"
    path.write_text(json.dumps({"per_turn": results, "raw": raw}))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
