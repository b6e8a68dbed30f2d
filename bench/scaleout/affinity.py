"""Affinity pays: the multi-turn workload on 1 replica, on 2 with hashing, on 2 round-robin.

    python -m bench.scaleout.affinity                 # 32 conversations x 6 turns
    python -m bench.scaleout.affinity --smoke         # checks the harness in a minute or two

Every run goes through the shipped nginx config to fresh replicas (cold
caches) on one Redis. The conversations use the OpenAI-compatible API and
resend their history each turn; in the hashing runs each request carries
``X-Session-Id`` (nginx hashes on it), in the round-robin run none does (nginx
then spreads requests round-robin), which is the whole difference. Figures
from the third turn on: token hit rate and TTFT p50/p95, side by side, plus
each replica's own hit rate from /admin/cache. Target: hashing within 2
points of one replica; round-robin visibly lower.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from bench.live_server import unique_prefix
from bench.multiturn.client import warm_up
from bench.multiturn.servers import served_model
from bench.scaleout import common
from bench.scaleout.drive import chat_workload, figures, tenant_keys
from bench.scaleout.fleet import Fleet
from chatsvc.store.embedded import EmbeddedRedis

RUNS = (
    ("1 replica", 1, True),
    ("2 replicas, hashing", 2, True),
    ("2 replicas, round-robin", 2, False),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scaleout.affinity", description=__doc__)
    common.add_workload_args(p, conversations=32, turns=6)
    args = p.parse_args(argv)
    if args.smoke:
        args.conversations, args.turns, args.concurrency = 4, 3, 4
        args.system_tokens, args.user_tokens, args.answer_tokens = "48", "12", "6"
        args.think_time, args.kv_blocks = "0", 512
    return args


async def _drive(fleet: Fleet, workload, keys, args, session_header: bool, label: str):
    headers = {"Authorization": f"Bearer {next(iter(keys.values()))}"}
    model = served_model(fleet.url, headers)
    for replica in fleet.replicas:
        await warm_up(replica.url, model, headers)
    return await chat_workload(
        fleet.url,
        workload,
        keys,
        model=model,
        session_header=session_header,
        concurrency=args.concurrency,
        label=label,
    )


def run(args: argparse.Namespace, work_dir: Path) -> dict:
    workload = common.workload(args)
    keys = tenant_keys(workload)
    results = {}
    with EmbeddedRedis(work_dir / "redis", appendfsync="everysec") as redis_server:
        for label, replicas, hashing in RUNS:
            print(f"[affinity] {label}: starting", flush=True)
            fleet = Fleet(
                work_dir / label.replace(" ", "_").replace(",", ""),
                redis_server.url,
                prefix=unique_prefix("affinity"),
                api_keys=keys,
                replicas=replicas,
                env=common.replica_extra_env(args, replicas),
            )
            with fleet:
                records = asyncio.run(_drive(fleet, workload, keys, args, hashing, label))
                per_replica = {}
                for i, rid in enumerate(fleet.ids):
                    overall = fleet.admin(i).json()["requests"]["overall"]
                    per_replica[rid] = overall
            entry = figures(records)
            entry["per_replica"] = per_replica
            entry["records"] = [asdict(r) for r in records]
            results[label] = entry
            print(f"[affinity] {label}: {_line(entry)}", flush=True)
    return {"workload": workload.description, "runs": results}


def _line(entry: dict) -> str:
    return (
        f"hit rate from turn 3 {common.fmt(entry['hit_rate_from_turn_3'], '%')}, "
        f"TTFT p50 {common.fmt(entry['ttft_p50_from_turn_3_s'], ' s')}, "
        f"p95 {common.fmt(entry['ttft_p95_from_turn_3_s'], ' s')}, errors {entry['errors']}"
    )


def table(result: dict) -> str:
    lines = [
        "| run | hit rate (turn >= 3) | TTFT p50 (turn >= 3) | TTFT p95 "
        "| per-replica hit rate | errors |",
        "|---|---|---|---|---|---|",
    ]
    for label, entry in result["runs"].items():
        per = ", ".join(
            f"{rid} {common.fmt(o['token_hit_rate'], '%')}"
            for rid, o in entry["per_replica"].items()
        )
        lines.append(
            f"| {label} | {common.fmt(entry['hit_rate_from_turn_3'], '%')} "
            f"| {common.fmt(entry['ttft_p50_from_turn_3_s'], ' s')} "
            f"| {common.fmt(entry['ttft_p95_from_turn_3_s'], ' s')} | {per} | {entry['errors']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-affinity-") as tmp:
        result = {"meta": common.meta(argv, "bench.scaleout.affinity"), **run(args, Path(tmp))}
    path = common.write_result(result, args.out, "affinity")
    print(table(result))
    print(f"[affinity] wrote {path}")
    errors = sum(e["errors"] for e in result["runs"].values())
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
