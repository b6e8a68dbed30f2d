"""Redis failover: SIGKILL the Valkey primary while conversations run; Sentinel promotes a replica.

    python -m bench.scaleout.failover                      # primary + 2 replicas, 8 conversations
    python -m bench.scaleout.failover --redis-replicas 1 --restart-old-primary
    python -m bench.scaleout.failover --smoke

One chatsvc replica runs on ``redis+sentinel://`` (every write confirmed by
one replica, the default). The conversations stream turns back to back; after
``--turns-before`` turns each the primary is killed. With two replicas the
promoted one still has a replica to confirm its writes; with one, writes stay
refused until the old primary is back as a replica (``--restart-old-primary``
restarts it once the promotion is seen, as an orchestrator would). Reported:
the window in which turns failed (first failed send after the kill to the
last failed answer), the first acknowledged turn after the kill, the failed
turns by kind, and every acknowledged turn checked in Redis on the new primary.
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
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
from bench.scaleout.valkey import SentinelTopology
from chatsvc.store import Store

TENANT, KEY = "failover", "failover-tenant-key-0001"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scaleout.failover", description=__doc__)
    common.add_workload_args(p, conversations=8, turns=3)
    p.add_argument("--turns-after", type=int, default=4, help="acknowledged turns each, after")
    p.add_argument("--redis-replicas", type=int, default=2, choices=(1, 2))
    p.add_argument("--restart-old-primary", action="store_true")
    p.add_argument("--down-after-ms", type=int, default=1000, help="Sentinel's down-after")
    args = p.parse_args(argv)
    if args.smoke:
        args.conversations, args.turns, args.turns_after = 3, 1, 2
        args.system_tokens, args.user_tokens, args.answer_tokens = "32", "8", "4"
        args.kv_blocks = 512
    args.think_time = "0"
    args.tenants = 1
    return args


async def _scenario(url: str, topo: SentinelTopology, workload, args) -> dict:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
        convs = [SessionConversation(conv, http) for conv in workload.conversations]
        await asyncio.gather(*(c.open() for c in convs))
        state = {"killed_at": None, "old": None, "promoted_at": None, "restarted": False}

        def kill() -> None:
            state["old"] = topo.kill_primary()
            state["killed_at"] = time.monotonic()

        def watch() -> None:
            # Runs between turns: notes the promotion, restarts the old node if asked.
            if state["killed_at"] is None or state["promoted_at"] is not None:
                return
            if topo.primary_port() != state["old"]:
                state["promoted_at"] = time.monotonic()
                if args.restart_old_primary:
                    topo.nodes[state["old"]].start()
                    state["restarted"] = True

        kill_gate = asyncio.Event()
        ready = 0

        async def converse(c: SessionConversation) -> None:
            nonlocal ready
            for i in range(args.turns):
                await c.turn(i)
            ready += 1
            if ready == len(convs):
                await asyncio.to_thread(kill)
                kill_gate.set()
            await kill_gate.wait()
            i, acked = args.turns, 0
            deadline = time.monotonic() + 300
            while acked < args.turns_after and time.monotonic() < deadline:
                record = await c.turn(i)
                i += 1
                await asyncio.to_thread(watch)
                if state["promoted_at"] is not None and record.at > state["promoted_at"]:
                    acked += record.outcome.acknowledged
                if not record.outcome.acknowledged:
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(converse(c) for c in convs))
    state["convs"] = convs
    return state


def _kind(outcome) -> str:
    if outcome.transport_error:
        return "transport error"
    error = (outcome.error or {}).get("error", {})
    if outcome.status == 200:
        return f"error event {error.get('type', '?')}"
    return f"HTTP {outcome.status} {error.get('type', '')}".strip()


def _report(state: dict, checks: list) -> dict:
    killed_at = state["killed_at"]
    turns = [t for c in state["convs"] for t in c.turns]
    after = [t for t in turns if t.at >= killed_at]
    failed = [t for t in after if not t.outcome.acknowledged]
    ok_after = [t for t in after if t.outcome.acknowledged]
    kinds: dict[str, int] = {}
    for t in failed:
        kinds[_kind(t.outcome)] = kinds.get(_kind(t.outcome), 0) + 1
    first_ok = min((t.at + (t.outcome.latency_s or 0) for t in ok_after), default=None)
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
        "turns_before_kill": sum(1 for t in turns if t.at < killed_at),
        "failed_turns_after_kill": len(failed),
        "failed_by_kind": kinds,
        "failure_window_s": (
            max(t.at + (t.outcome.latency_s or 0) for t in failed) - min(t.at for t in failed)
            if failed
            else 0.0
        ),
        "first_ack_after_kill_s": None if first_ok is None else first_ok - killed_at,
        "promoted_after_s": (
            None if state["promoted_at"] is None else state["promoted_at"] - killed_at
        ),
        "old_primary_restarted": state["restarted"],
        "acknowledged_turns": sum(c.log.num_acknowledged for c in state["convs"]),
        "committed_unacknowledged": sum(v.committed_unacknowledged for v in checks),
        "problems": [p for v in checks for p in v.problems],
        "conversations_continued": sum(
            1
            for c in state["convs"]
            if any(t.outcome.acknowledged for t in c.turns if t.at >= killed_at)
        ),
        "conversations": len(state["convs"]),
    }


async def _check(url: str, prefix: str, convs) -> list:
    store = await Store.connect(url, prefix=prefix)
    try:
        tenant = await store.tenants.by_name(TENANT)
        return [await verify(store, tenant.id, c.log) for c in convs]
    finally:
        await store.close()


def run(args: argparse.Namespace, work_dir: Path) -> dict:
    workload = common.workload(args)
    prefix = unique_prefix("failover")
    env = {**common.replica_extra_env(args, 1), "CHATSVC_TURN_LOCK_TTL_S": "5"}
    with SentinelTopology(
        work_dir / "valkey", num_replicas=args.redis_replicas, down_after_ms=args.down_after_ms
    ) as topo:
        url = topo.sentinel_url()
        with Fleet(
            work_dir / "fleet",
            url,
            prefix=prefix,
            api_keys={TENANT: KEY},
            replicas=1,
            nginx=False,
            env=env,
        ) as fleet:
            state = asyncio.run(_scenario(fleet.replicas[0].url, topo, workload, args))
        checks = asyncio.run(_check(url, prefix, state["convs"]))
    report = _report(state, checks)
    report["redis_replicas"] = args.redis_replicas
    return report


def summary(r: dict) -> str:
    return "\n".join(
        [
            f"primary + {r['redis_replicas']} replica(s); Sentinel promoted after "
            f"{common.fmt(r['promoted_after_s'], ' s', 2)}"
            + (" (old primary restarted then)" if r["old_primary_restarted"] else ""),
            f"failed turns after the kill: {r['failed_turns_after_kill']} {r['failed_by_kind']}",
            f"failure window {common.fmt(r['failure_window_s'], ' s', 2)}; first acknowledged "
            f"turn {common.fmt(r['first_ack_after_kill_s'], ' s', 2)} after the kill",
            f"acknowledged turns: {r['acknowledged_turns']} (all checked in Redis), committed but "
            f"unacknowledged: {r['committed_unacknowledged']}, problems: {len(r['problems'])}",
            *(f"  - {p}" for p in r["problems"]),
            f"conversations that went on: {r['conversations_continued']} of {r['conversations']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as tmp:
        report = run(args, Path(tmp))
    result = {"meta": common.meta(argv, "bench.scaleout.failover"), "report": report}
    path = common.write_result(result, args.out, "failover")
    print(summary(report))
    print(f"[failover] wrote {path}")
    failed = report["problems"] or report["conversations_continued"] < report["conversations"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
