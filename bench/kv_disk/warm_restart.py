"""Warm restart: turn 5 of many sessions after a restart, from the disk tier.

    .venv/bin/python -m bench.kv_disk.warm_restart [--sessions 32] [--turns 4]
        [--max-tokens 64] [--question-words 60] [--system-repeat 6]

Phase 1: ``--sessions`` conversations run ``--turns`` turns each (concurrently,
each one turn after another) on an engine with the disk tier on; the script
checks that every history reaches ``--min-history`` tokens. Then turn
``turns + 1`` of every session is sent at once, three times from the same
histories:

    (a) no restart: the same engine, its memory tiers warm
    (b) restart, disk tier off: a new engine, the whole history recomputed
    (c) restart, disk tier on: a new engine on the files phase 1 left

(c) runs on a hard-linked snapshot of the directory taken before (a), so (a)'s
own blocks cannot help it. Prints TTFT p50/p90 of that turn per run, the
ratios against the targets (c within 1.5x of (a), at least 5x under (b)), and
where (c)'s cached tokens came from.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.kv_disk.common import (
    add_common_args,
    engine_config,
    new_conversations,
    p50,
    percentile,
    run_turn,
    settle,
    started,
)


def snapshot(src: Path, dst: Path) -> int:
    """Hard-link every block file (they are written once, never changed in place)."""
    count = 0
    for path in src.rglob("*.kv"):
        target = dst / path.relative_to(src)
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.link(path, target)
        count += 1
    for directory in [dst, *dst.rglob("*")]:
        if directory.is_dir():
            directory.chmod(0o700)
    return count


async def last_turn(engine, convs, turn, args, tag) -> list[dict]:
    histories = [list(c.history) for c in convs]
    rows = await asyncio.gather(*(run_turn(engine, c, turn, args, tag) for c in convs))
    for conv, history in zip(convs, histories, strict=True):
        conv.history = history  # every run starts from the same histories
    return rows


async def main_async(args) -> None:
    root = Path(args.kv_dir or tempfile.mkdtemp(prefix="kv-warm-"))
    live, snap = root / "live", root / "snapshot"
    engine = await started(engine_config(args, kv_disk_dir=str(live)))
    convs = new_conversations(engine, args.sessions, args.system_repeat)

    async def converse(conv):
        for turn in range(args.turns):
            await run_turn(engine, conv, turn, args, "warm-")

    start = time.perf_counter()
    await asyncio.gather(*(converse(c) for c in convs))
    phase1 = time.perf_counter() - start
    shortest = min(len(c.history) for c in convs)
    await settle(engine)
    num_files = snapshot(live, snap)
    turn = args.turns
    no_restart = await last_turn(engine, convs, turn, args, "a-")
    await engine.stop()

    cold = await started(engine_config(args, kv_disk_bytes=0))
    disk_off = await last_turn(cold, convs, turn, args, "b-")
    await cold.stop()

    start = time.perf_counter()
    warm = await started(engine_config(args, kv_disk_dir=str(snap)))
    restart_s = time.perf_counter() - start
    disk_on = await last_turn(warm, convs, turn, args, "c-")
    disk_stats = warm.cache_stats()["disk"]
    await warm.stop()
    if not args.kv_dir:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"model={args.model} sessions={args.sessions} turns={args.turns} "
        f"max_tokens={args.max_tokens} phase1={phase1:.1f}s shortest_history={shortest} tokens "
        f"files={num_files}"
    )
    if shortest < args.min_history:
        print(f"WARNING: a history has {shortest} tokens, under --min-history {args.min_history}")
    print(f"turn {turn + 1}, all sessions at once   ttft_p50_ms  ttft_p90_ms  cached/prompt")
    for name, rows in (
        ("(a) no restart", no_restart),
        ("(b) restart, disk tier off", disk_off),
        ("(c) restart, disk tier on", disk_on),
    ):
        ttfts = [r["ttft"] for r in rows]
        cached, prompt = sum(r["cached"] for r in rows), sum(r["prompt"] for r in rows)
        print(
            f"{name:<32} {p50(ttfts) * 1e3:>11.1f}  {percentile(ttfts, 90) * 1e3:>11.1f}  "
            f"{cached}/{prompt}"
        )
    a = p50([r["ttft"] for r in no_restart])
    b = p50([r["ttft"] for r in disk_off])
    c = p50([r["ttft"] for r in disk_on])
    print(f"(c)/(a) p50 = {c / a:.2f}x (target <= 1.5x); (b)/(c) p50 = {b / c:.1f}x (target >= 5x)")
    tiers = {t: sum(r["by_tier"].get(t, 0) for r in disk_on) for t in ("device", "host", "disk")}
    print(
        f"(c) cached tokens by tier {tiers}; engine start incl. index rebuild {restart_s:.1f}s; "
        f"disk loads {disk_stats['loaded_blocks']} blocks, "
        f"{disk_stats['loaded_bytes'] / 2**20:.0f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4, help="turns before the restart")
    parser.add_argument("--min-history", type=int, default=1000)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
