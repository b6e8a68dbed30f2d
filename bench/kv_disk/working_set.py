"""A working set ten times the pool: many idle-then-active sessions, with and without disk.

    .venv/bin/python -m bench.kv_disk.working_set [--sessions 200] [--turns 6]
        [--think-time 20] [--pool-fraction 0.1] [--kv-disk-bytes N]

``--sessions`` conversations of ``--turns`` turns each; before every later turn
a user thinks uniform 0..``--think-time`` s (seeded, the same in every run), so
most sessions sit idle at any moment, as in real chat traffic. Three runs:

    disk on      device pool = --pool-fraction of the sessions' final KV, disk tier on
    disk off     the same pool, no disk tier
    all memory   a pool that holds everything (the ceiling)

``--compare-write-back`` adds a disk-on run in write-back mode, to set its
disk traffic and TTFT beside write-through's (and how much of the KV either
leaves on disk should the process die before a clean stop).

``--kv-disk-bytes`` sets the disk budget; by default it is the tier's automatic
one (a share of the free space), which may hold less than the sessions' KV:
the disk-on run prints its budget in blocks beside the blocks in all.

Printed per run: the prefix hit rate against the ideal (every token some
earlier request computed, at block granularity, never the last prompt token),
TTFT p50/p99 per turn, and tier traffic (hits per tier, disk loads and stores,
evictions). Targets: hit rate >= 95 % of the ideal with the disk tier; TTFT p50
from turn 3 within 2x of the all-in-memory run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
from pathlib import Path

from bench.engine import IdealTracker
from bench.kv_disk.common import (
    add_common_args,
    engine_config,
    new_conversations,
    p50,
    pause,
    percentile,
    question,
    run_turn,
    settle,
    started,
)


async def one_run(
    args, num_blocks: int | None, disk_dir: str | None, write: str = "through", **config
) -> dict:
    """One run of the conversations; ``num_blocks`` None: the pool sized by ``config``'s
    ``kv_cache_bytes`` (bench/kv_capacity.py)."""
    overrides = {"num_gpu_blocks": num_blocks, "num_host_blocks": 0, "kv_disk_write": write}
    overrides.update({"kv_disk_dir": disk_dir} if disk_dir else {"kv_disk_bytes": 0})
    overrides.update(config)
    engine = await started(engine_config(args, **overrides))
    convs = new_conversations(engine, args.sessions, args.system_repeat)
    tracker = IdealTracker(16)

    async def converse(conv):
        rng = random.Random(conv.conv)
        for turn in range(args.turns):
            if turn:
                await asyncio.sleep(pause(rng, args.think_time))
            row = await run_turn(engine, conv, turn, args)
            # Ideal: what any earlier request computed (only this session's own turns
            # and the shared system prompt can match: histories are private).
            row["ideal"] = tracker.ideal(conv.history[: row["prompt"]])
            tracker.add(conv.history[: row["computed"]])

    await asyncio.gather(*(converse(c) for c in convs))
    await settle(engine)
    # What a crash now would leave on disk (a clean stop also stores the rest).
    stats = engine.cache_stats()
    await engine.stop()
    rows = [r for c in convs for r in c.rows]
    return {"rows": rows, "stats": stats, "blocks": stats["device"]["total"]}


def report(name: str, run: dict, turns: int) -> None:
    rows, stats = run["rows"], run["stats"]
    hit = sum(r["cached"] for r in rows)
    ideal = sum(r["ideal"] for r in rows)
    print(
        f"\n{name}: pool {run['blocks']} blocks; hit {hit}/{ideal} ideal tokens = "
        f"{hit / ideal if ideal else 1.0:.1%} of ideal"
    )
    print("turn  ttft_p50_ms  ttft_p99_ms")
    for turn in range(turns):
        ttfts = [r["ttft"] for r in rows if r["turn"] == turn]
        print(f"{turn + 1:>4}  {p50(ttfts) * 1e3:>11.1f}  {percentile(ttfts, 99) * 1e3:>11.1f}")
    later = [r["ttft"] for r in rows if r["turn"] >= 2]
    print(f"  3+  {p50(later) * 1e3:>11.1f}  {percentile(later, 99) * 1e3:>11.1f}  (pooled)")
    disk = stats.get("disk") or {}
    print(
        f"hits by tier {stats['hit_tokens_by_tier']}; evictions {stats['evictions']}; "
        f"preemptions {stats['num_preemptions']}"
    )
    if "loaded_blocks" in disk:
        print(
            f"disk: {disk['blocks']} blocks on disk before shutdown ({disk['write_mode']}); "
            f"budget {disk['budget_bytes'] / 2**30:.1f} GiB = {disk['total']} blocks"
        )
        print(
            f"disk: loaded {disk['loaded_blocks']} blocks "
            f"({disk['loaded_bytes'] / 2**20:.0f} MiB), "
            f"stored {disk['stored_blocks']} ({disk['stored_bytes'] / 2**20:.0f} MiB), "
            f"dropped {disk['dropped_blocks']}"
        )


async def session_size(args) -> tuple[int, int]:
    """(tokens a session ends with: prompt + answers of every turn, bytes of one KV block
    in the model's dtype), from a small engine started for it."""
    probe = await started(engine_config(args, num_gpu_blocks=64, kv_disk_bytes=0))
    convs = new_conversations(probe, 1, args.system_repeat)
    system_len = len(convs[0].history)
    fmt = probe.chat_format
    per_turn = len(fmt.tokenize(question(0, 0, args.question_words))) + 12 + args.max_tokens
    block_bytes = probe.cache_stats()["block_bytes"]
    await probe.stop()
    return system_len + args.turns * per_turn, block_bytes


async def main_async(args) -> None:
    # Size the pool from the sessions' final KV.
    tokens_per_session, _ = await session_size(args)
    total_blocks = args.sessions * tokens_per_session // 16
    small = max(int(total_blocks * args.pool_fraction), 2 * tokens_per_session // 16 + 8)
    large = total_blocks + 2 * args.sessions + 64
    print(
        f"model={args.model} sessions={args.sessions} turns={args.turns} "
        f"think_time={args.think_time}s ~{tokens_per_session} tokens/session: "
        f"{total_blocks} blocks in all; small pool {small} ({small / total_blocks:.0%})"
    )
    root = Path(args.kv_dir or tempfile.mkdtemp(prefix="kv-ws-"))
    runs = {"disk on": await one_run(args, small, str(root / "on"))}
    if args.compare_write_back:
        runs["disk on, write-back"] = await one_run(args, small, str(root / "back"), "back")
    runs["disk off"] = await one_run(args, small, None)
    runs["all memory"] = await one_run(args, large, None)
    if not args.kv_dir:
        shutil.rmtree(root, ignore_errors=True)
    for name, run in runs.items():
        report(name, run, args.turns)

    def later_p50(run):
        return p50([r["ttft"] for r in run["rows"] if r["turn"] >= 2])

    on = runs["disk on"]
    ratio = sum(r["cached"] for r in on["rows"]) / max(1, sum(r["ideal"] for r in on["rows"]))
    print(
        f"\ndisk on: hit rate {ratio:.1%} of ideal (target >= 95 %); TTFT p50 turns 3+ "
        f"{later_p50(on) / later_p50(runs['all memory']):.2f}x all-memory (target <= 2x), "
        f"disk off {later_p50(runs['disk off']) / later_p50(runs['all memory']):.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--think-time", type=float, default=20.0)
    parser.add_argument("--pool-fraction", type=float, default=0.1)
    parser.add_argument(
        "--compare-write-back",
        action="store_true",
        help="also run the disk tier in write-back mode (the default is write-through)",
    )
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
