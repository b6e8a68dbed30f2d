"""Replica death: SIGKILL one of two replicas while 16 conversations stream through nginx.

    python -m bench.scaleout.replica_death            # 16 conversations, 3 turns, kill, 3 turns
    python -m bench.scaleout.replica_death --smoke

The conversations use the sessions API (history in Redis, turns over SSE).
After ``--turns-before`` turns each, every conversation starts one more; once
half of the victim's conversations are mid-generation, the victim is killed.
Every conversation then goes on for ``--turns-after`` turns through nginx,
retrying a failed turn as a client would (a 409 while the dead replica's turn
lock expires is waited out). Reported: every acknowledged turn checked in
Redis word for word (bench/reliability/history.py), how the cut turns failed,
how long each moved conversation saw errors (first failed send to first
acknowledged turn), and the TTFT of its first turn after the move (the
survivor rebuilds its KV from the stored tokens) against its usual TTFT.
Exit status 1 if a check fails.
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
from bench.reliability.history import verify
from bench.scaleout import common
from bench.scaleout.drive import SessionConversation
from bench.scaleout.fleet import Fleet
from chatsvc.store import Store
from chatsvc.store.embedded import EmbeddedRedis

TENANT, KEY = "death", "death-tenant-key-000001"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scaleout.replica_death", description=__doc__)
    common.add_workload_args(p, conversations=16, turns=3)
    p.add_argument("--turns-after", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48, help="answer tokens of the cut turn")
    args = p.parse_args(argv)
    if args.smoke:
        args.conversations, args.turns, args.turns_after = 4, 1, 1
        args.system_tokens, args.user_tokens, args.answer_tokens = "48", "12", "8"
        args.kv_blocks, args.max_tokens = 512, 32
    args.think_time = "0"
    args.tenants = 1
    return args


def _homes(fleet: Fleet, convs: list[SessionConversation]) -> dict[str, int]:
    paths = {f"/sessions/{c.session_id}/messages": c.session_id for c in convs}
    entries = fleet.nginx.wait_for_entries(
        lambda es: set(paths) <= {e.path for e in es if e.status == 200}
    )
    return {paths[e.path]: fleet.replica_of(e.upstream) for e in entries if e.path in paths}


async def _scenario(fleet: Fleet, workload, args) -> dict:
    limits = httpx.Limits(max_connections=4 * args.conversations)
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(
        base_url=fleet.url, headers=headers, timeout=600, limits=limits
    ) as http:
        convs = [SessionConversation(conv, http) for conv in workload.conversations]
        await asyncio.gather(*(c.open() for c in convs))

        async def before(c: SessionConversation) -> None:
            for i in range(args.turns):
                await c.turn(i)

        await asyncio.gather(*(before(c) for c in convs))
        homes = _homes(fleet, convs)
        victim = 0
        affected = [c for c in convs if homes[c.session_id] == victim]
        wanted = max(1, len(affected) // 2)
        enough = asyncio.Event()

        def on_delta(_: SessionConversation) -> None:
            if sum(c.mid_stream for c in affected) >= wanted:
                enough.set()

        async def in_flight(c: SessionConversation):
            return await c.turn(args.turns, on_delta, max_tokens=args.max_tokens)

        tasks = [asyncio.create_task(in_flight(c)) for c in convs]
        waiter = asyncio.create_task(enough.wait())
        await asyncio.wait([waiter, asyncio.gather(*tasks)], return_when=asyncio.FIRST_COMPLETED)
        mid_at_kill = sum(c.mid_stream for c in affected)
        killed_at = time.monotonic()
        await asyncio.to_thread(fleet.kill, victim)
        cut = await asyncio.gather(*tasks)
        waiter.cancel()

        async def after(c: SessionConversation) -> None:
            done, i = 0, args.turns + 1
            while done < args.turns_after:
                record = await c.turn(i)
                i += 1
                done += record.outcome.acknowledged
                if i > args.turns + 1 + 3 * args.turns_after + 10:
                    return  # gives up; the Redis check reports it

        await asyncio.gather(*(after(c) for c in convs))
    return {
        "convs": convs,
        "homes": homes,
        "affected": affected,
        "cut": cut,
        "killed_at": killed_at,
        "mid_at_kill": mid_at_kill,
    }


def _report(state: dict, args, checks: list) -> dict:
    affected = state["affected"]
    killed_at = state["killed_at"]
    cut = [
        (c, r)
        for c, r in zip(state["convs"], state["cut"], strict=True)
        if not r.outcome.acknowledged
    ]
    windows, first_after, usual = [], [], []
    for c in affected:
        later = [t for t in c.turns if t.at + (t.outcome.latency_s or 0) >= killed_at]
        failed = [t for t in later if not t.outcome.acknowledged]
        ok = [t for t in later if t.outcome.acknowledged]
        if failed and ok:
            windows.append(ok[0].at + (ok[0].outcome.ttft_s or 0) - failed[0].at)
        if ok and ok[0].outcome.ttft_s is not None:
            first_after.append(ok[0].outcome.ttft_s)
        before = [
            t.outcome.ttft_s
            for t in c.turns
            if t.at < killed_at and t.turn >= 1 and t.outcome.acknowledged and t.outcome.ttft_s
        ]
        if before:
            usual.append(statistics.median(before))
    kinds: dict[str, int] = {}
    for _, r in cut:
        o = r.outcome
        kind = (
            "stream cut (transport error)"
            if o.transport_error
            else f"HTTP {o.status} {(o.error or {}).get('error', {}).get('type', '')}".strip()
        )
        kinds[kind] = kinds.get(kind, 0) + 1
    problems = [p for v in checks for p in v.problems]
    timeline = [
        {
            "conversation": i,
            "turn": t.turn,
            "sent_after_kill_s": t.at - killed_at,
            "status": t.outcome.status,
            "acknowledged": t.outcome.acknowledged,
            "ttft_s": t.outcome.ttft_s,
            "latency_s": t.outcome.latency_s,
            "error": t.outcome.error or t.outcome.transport_error,
        }
        for i, c in enumerate(state["convs"])
        for t in c.turns
    ]
    return {
        "timeline": timeline,
        "conversations": len(state["convs"]),
        "on_victim": len(affected),
        "victim_mid_stream_at_kill": state["mid_at_kill"],
        "cut_turns": len(cut),
        "cut_turn_errors": kinds,
        "acknowledged_turns": sum(c.log.num_acknowledged for c in state["convs"]),
        "committed_unacknowledged": sum(v.committed_unacknowledged for v in checks),
        "problems": problems,
        "error_window_s": {
            "max": max(windows, default=None),
            "median": statistics.median(windows) if windows else None,
        },
        "ttft_first_after_move_s": statistics.median(first_after) if first_after else None,
        "ttft_usual_s": statistics.median(usual) if usual else None,
        "conversations_continued": sum(
            1
            for c in state["convs"]
            if any(t.outcome.acknowledged for t in c.turns if t.at >= killed_at)
        ),
    }


async def _check(redis_url: str, prefix: str, convs) -> list:
    store = await Store.connect(redis_url, prefix=prefix)
    try:
        tenant = await store.tenants.by_name(TENANT)
        return [await verify(store, tenant.id, c.log) for c in convs]
    finally:
        await store.close()


def run(args: argparse.Namespace, work_dir: Path) -> dict:
    workload = common.workload(args)
    prefix = unique_prefix("death")
    env = {**common.replica_extra_env(args, 2), "CHATSVC_TURN_LOCK_TTL_S": "5"}
    with EmbeddedRedis(work_dir / "redis") as redis_server:
        with Fleet(
            work_dir / "fleet", redis_server.url, prefix=prefix, api_keys={TENANT: KEY}, env=env
        ) as fleet:
            state = asyncio.run(_scenario(fleet, workload, args))
            survivor = fleet.admin(1).json()["affinity"]
        checks = asyncio.run(_check(redis_server.url, prefix, state["convs"]))
    report = _report(state, args, checks)
    report["survivor_affinity"] = survivor
    return report


def summary(r: dict) -> str:
    return "\n".join(
        [
            f"conversations {r['conversations']}, {r['on_victim']} on the killed replica "
            f"({r['victim_mid_stream_at_kill']} mid-stream at the kill)",
            f"cut turns: {r['cut_turns']} {r['cut_turn_errors']}",
            f"acknowledged turns: {r['acknowledged_turns']} (all checked in Redis), committed but "
            f"unacknowledged: {r['committed_unacknowledged']}, problems: {len(r['problems'])}",
            *(f"  - {p}" for p in r["problems"]),
            f"conversations that went on after the kill: {r['conversations_continued']}",
            f"error window of a moved conversation: median "
            f"{common.fmt(r['error_window_s']['median'], ' s', 2)}, "
            f"max {common.fmt(r['error_window_s']['max'], ' s', 2)}",
            "TTFT of the first turn after the move "
            f"{common.fmt(r['ttft_first_after_move_s'], ' s')} "
            f"vs usual {common.fmt(r['ttft_usual_s'], ' s')}",
            f"survivor's affinity misses: {r['survivor_affinity']['affinity_misses']}, "
            f"recomputed tokens {r['survivor_affinity']['recomputed_tokens']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-death-") as tmp:
        report = run(args, Path(tmp))
    result = {"meta": common.meta(argv, "bench.scaleout.replica_death"), "report": report}
    path = common.write_result(result, args.out, "replica-death")
    print(summary(report))
    print(f"[replica_death] wrote {path}")
    failed = report["problems"] or report["conversations_continued"] < report["conversations"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
