"""The Redis side of a turn: what one stored turn costs the primary, for sizing a fleet.

    python -m bench.scaleout.store_turns              # 2,000 turns over 200 sessions, 32 at once
    python -m bench.scaleout.store_turns --smoke

Runs the store calls of one chat turn (turn lock, session and history reads,
commit_turn, release: what chatsvc/api/turn/ does, without a model) against
two setups: one Valkey with the AOF fsynced on every write (``redis://``), and
a primary with two replicas behind Sentinel (``redis+sentinel://``, every
MULTI/EXEC confirmed by WAIT 1, AOF fsync always on every node). Reported per
setup: turns/s and the store latency per turn seen by this one client (a
Python client; the server is far from saturated), the primary's CPU seconds
per turn (INFO cpu, the figure that sizes a primary), its commands per turn,
and the memory its sessions' keys take (MEMORY USAGE) per session and per token
of history.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import redis

from bench.multiturn.report import percentile
from bench.scaleout import common
from bench.scaleout.valkey import SentinelTopology
from chatsvc.store import SessionBusyError, Store
from chatsvc.store.embedded import EmbeddedRedis
from chatsvc.store.records import MessageRecord, Usage


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scaleout.store_turns", description=__doc__)
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--turns", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--turn-tokens", type=int, default=64, help="user + assistant tokens per turn")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.sessions, args.turns, args.concurrency = 10, 60, 4
    return args


def _server_stats(client: redis.Redis) -> tuple[float, int, int]:
    cpu = client.info("cpu")
    return (
        cpu["used_cpu_sys"] + cpu["used_cpu_user"],
        client.info("stats")["total_commands_processed"],
        client.info("memory")["used_memory"],
    )


async def _turns(url: str, args, primary: redis.Redis) -> dict:
    rng = random.Random(0)
    store = await Store.connect(url, prefix="sizing")
    try:
        tenant = await store.tenants.ensure("sizing")
        mem0 = _server_stats(primary)[2]
        system = [rng.randrange(49152) for _ in range(args.system_tokens)]
        sessions = [
            await store.sessions.create(tenant.id, None, "You are brief." * 20, system, {})
            for _ in range(args.sessions)
        ]
        half = args.turn_tokens // 2
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(args.turns):
            queue.put_nowait(sessions[i % len(sessions)].id)
        latencies: list[float] = []
        busy = 0

        async def worker() -> None:
            nonlocal busy
            while not queue.empty():
                sid = queue.get_nowait()
                start = time.perf_counter()
                try:
                    async with store.sessions.turn_lock(tenant.id, sid) as lock:
                        session = await store.sessions.get(tenant.id, sid)
                        await store.tree.messages(tenant.id, sid)
                        user = [rng.randrange(49152) for _ in range(half)]
                        answer = [rng.randrange(49152) for _ in range(half)]
                        await store.branches.commit_turn(
                            tenant.id,
                            sid,
                            parent_id=session.active_leaf,
                            inputs=[MessageRecord(role="user", text="word " * half, token_ids=[])],
                            output=MessageRecord(
                                role="assistant",
                                text="word " * half,
                                token_ids=answer,
                                usage=Usage(
                                    prompt_tokens=len(session.token_ids) + half,
                                    cached_tokens=0,
                                    completion_tokens=half,
                                ),
                            ),
                            prompt_token_ids=[*session.token_ids, *user],
                            lock=lock,
                        )
                except SessionBusyError:  # another worker holds this session: requeue it
                    busy += 1
                    queue.put_nowait(sid)
                    await asyncio.sleep(0)
                    continue
                latencies.append(time.perf_counter() - start)

        cpu0, cmds0, _ = _server_stats(primary)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - started
        cpu1, cmds1, mem1 = _server_stats(primary)
        tokens = args.sessions * args.system_tokens + len(latencies) * args.turn_tokens
        # The sessions' own keys (MEMORY USAGE), apart from replication buffers
        # and the allocator's slack that used_memory also counts.
        session_bytes = sum(
            primary.memory_usage(key) or 0
            for s in sessions
            for key in store.keys.session_keys(s.id)
        )
        return {
            "turns": len(latencies),
            "turns_per_s": len(latencies) / wall,
            "latency_p50_ms": 1e3 * percentile(latencies, 50),
            "latency_p99_ms": 1e3 * percentile(latencies, 99),
            "primary_cpu_ms_per_turn": 1e3 * (cpu1 - cpu0) / len(latencies),
            "commands_per_turn": (cmds1 - cmds0) / len(latencies),
            "bytes_per_session": session_bytes / args.sessions,
            "bytes_per_token": session_bytes / tokens,
            "used_memory_growth_per_session": (mem1 - mem0) / args.sessions,
            "lock_conflicts_requeued": busy,
        }
    finally:
        await store.close()


def run(args, work_dir: Path) -> dict:
    results = {}
    with EmbeddedRedis(work_dir / "single", appendfsync="always") as single:
        with redis.Redis.from_url(single.url) as primary:
            results["1 node, AOF fsync always"] = asyncio.run(_turns(single.url, args, primary))
    with SentinelTopology(work_dir / "sentinel", num_replicas=2) as topo:
        with topo.primary().client() as primary:
            results["primary + 2 replicas, WAIT 1"] = asyncio.run(
                _turns(topo.sentinel_url(), args, primary)
            )
    return results


def table(results: dict) -> str:
    lines = [
        "| setup | turns/s (1 client) | store p50 / p99 per turn | primary CPU per turn "
        "| commands per turn | bytes per session | bytes per token |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, r in results.items():
        lines.append(
            f"| {label} | {r['turns_per_s']:.0f} | {r['latency_p50_ms']:.1f} / "
            f"{r['latency_p99_ms']:.1f} ms | {r['primary_cpu_ms_per_turn']:.3f} ms "
            f"| {r['commands_per_turn']:.1f} | {r['bytes_per_session']:.0f} "
            f"| {r['bytes_per_token']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        results = run(args, Path(tmp))
    result = {"meta": common.meta(argv, "bench.scaleout.store_turns"), "results": results}
    path = common.write_result(result, args.out, "store-turns")
    print(table(results))
    print(f"[store_turns] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
