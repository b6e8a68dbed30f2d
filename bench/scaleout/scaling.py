"""Scaling figure: the multi-turn workload on 1 replica direct, 1 behind nginx, 2 behind nginx.

    python -m bench.scaleout.scaling                 # 32 conversations x 6 turns, concurrency 8
    python -m bench.scaleout.scaling --smoke

Each configuration gets fresh replicas (cold caches) and the same workload
(OpenAI-compatible API with ``X-Session-Id``, so nginx hashes). Reported per
configuration: requests/s and completion tokens/s over the run, TTFT p50/p95
(all turns and from the third), hit rate. On a machine whose cores all serve
one replica already, a second replica on the same cores gains nothing: the
point is the harness and the cost of nginx, which is also measured directly
(``--probe`` sequential GET /healthz, direct and through nginx, median each).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.live_server import unique_prefix
from bench.multiturn.client import warm_up
from bench.multiturn.report import percentile
from bench.multiturn.servers import served_model
from bench.scaleout import common
from bench.scaleout.drive import chat_workload, figures, tenant_keys
from bench.scaleout.fleet import Fleet
from chatsvc.store.embedded import EmbeddedRedis

CONFIGS = (
    ("1 replica, direct", 1, False),
    ("1 replica, nginx", 1, True),
    ("2 replicas, nginx", 2, True),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scaleout.scaling", description=__doc__)
    common.add_workload_args(p, conversations=32, turns=6)
    p.add_argument("--probe", type=int, default=500, help="GET /healthz per path for the overhead")
    args = p.parse_args(argv)
    if args.smoke:
        args.conversations, args.turns, args.concurrency, args.probe = 4, 2, 4, 50
        args.system_tokens, args.user_tokens, args.answer_tokens = "48", "12", "6"
        args.think_time, args.kv_blocks = "0", 512
    return args


def probe(url: str, n: int) -> dict:
    """Median and p95 of ``n`` sequential GET /healthz on one kept-alive connection."""
    times = []
    with httpx.Client(base_url=url, timeout=30) as http:
        http.get("/healthz")
        for _ in range(n):
            start = time.perf_counter()
            http.get("/healthz").raise_for_status()
            times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "p95_s": percentile(times, 95)}


async def _drive(base: str, fleet: Fleet, workload, keys, args, label: str):
    headers = {"Authorization": f"Bearer {next(iter(keys.values()))}"}
    model = served_model(base, headers)
    for replica in fleet.replicas:
        await warm_up(replica.url, model, headers)
    started = time.perf_counter()
    records = await chat_workload(
        base,
        workload,
        keys,
        model=model,
        session_header=True,
        concurrency=args.concurrency,
        label=label,
    )
    return records, time.perf_counter() - started


def run(args: argparse.Namespace, work_dir: Path) -> dict:
    workload = common.workload(args)
    keys = tenant_keys(workload)
    results = {}
    overhead = None
    with EmbeddedRedis(work_dir / "redis", appendfsync="everysec") as redis_server:
        for label, replicas, via_nginx in CONFIGS:
            print(f"[scaling] {label}: starting", flush=True)
            fleet = Fleet(
                work_dir / label.replace(" ", "_").replace(",", ""),
                redis_server.url,
                prefix=unique_prefix("scaling"),
                api_keys=keys,
                replicas=replicas,
                env=common.replica_extra_env(args, replicas),
            )
            with fleet:
                if overhead is None and args.probe:
                    direct = probe(fleet.replicas[0].url, args.probe)
                    proxied = probe(fleet.url, args.probe)
                    overhead = {
                        "direct": direct,
                        "nginx": proxied,
                        "added_median_s": proxied["median_s"] - direct["median_s"],
                    }
                base = fleet.url if via_nginx else fleet.replicas[0].url
                records, wall = asyncio.run(_drive(base, fleet, workload, keys, args, label))
            entry = figures(records)
            ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
            entry["ttft_p50_s"] = percentile(ttfts, 50)
            entry["ttft_p95_s"] = percentile(ttfts, 95)
            entry["wall_s"] = wall
            results[label] = entry
            print(f"[scaling] {label}: {_line(entry)}", flush=True)
    return {"workload": workload.description, "runs": results, "nginx_overhead": overhead}


def _line(e: dict) -> str:
    return (
        f"{common.fmt(e['requests_per_s'], ' req/s', 2)}, "
        f"{common.fmt(e['completion_tokens_per_s'], ' tok/s', 1)}, "
        f"TTFT p50 {common.fmt(e['ttft_p50_s'], ' s')}, errors {e['errors']}"
    )


def table(result: dict) -> str:
    lines = [
        "| configuration | requests/s | completion tok/s | TTFT p50 | TTFT p95 "
        "| TTFT p50 (turn >= 3) | hit rate (turn >= 3) | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, e in result["runs"].items():
        lines.append(
            f"| {label} | {common.fmt(e['requests_per_s'], '', 2)} "
            f"| {common.fmt(e['completion_tokens_per_s'], '', 1)} "
            f"| {common.fmt(e['ttft_p50_s'], ' s')} | {common.fmt(e['ttft_p95_s'], ' s')} "
            f"| {common.fmt(e['ttft_p50_from_turn_3_s'], ' s')} "
            f"| {common.fmt(e['hit_rate_from_turn_3'], '%')} | {e['errors']} |"
        )
    o = result.get("nginx_overhead")
    if o:
        lines.append(
            f"\nGET /healthz median: direct {1e3 * o['direct']['median_s']:.2f} ms, through nginx "
            f"{1e3 * o['nginx']['median_s']:.2f} ms (nginx adds {1e3 * o['added_median_s']:.2f} ms)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        result = {"meta": common.meta(argv, "bench.scaleout.scaling"), **run(args, Path(tmp))}
    path = common.write_result(result, args.out, "scaling")
    print(table(result))
    print(f"[scaling] wrote {path}")
    return 1 if any(e["errors"] for e in result["runs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
