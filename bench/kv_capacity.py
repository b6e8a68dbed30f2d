"""Sessions a pool of fixed bytes holds with int8 KV against KV in the model's dtype.

    .venv/bin/python -m bench.kv_capacity [--sessions 40] [--turns 4] [--think-time 5]
        [--pool-fraction 0.25] [the working-set benchmark's engine options]

The working-set benchmark's conversations (``bench/kv_disk/working_set.py``: sessions
idle between turns for seeded think times, histories private, a shared system prompt) on
a device pool of fixed *bytes*, no host or disk tier: the bytes that hold
``--pool-fraction`` of the sessions' final KV in the model's dtype. Each KV dtype's run
sizes its pool from those bytes (``kv_cache_bytes``), as the service does, so int8 gets
the blocks its smaller blocks allow. Printed per KV dtype: the pool's blocks and bytes per
block, the cached tokens per pool byte, the sessions the pool holds whole (pool tokens /
a session's final tokens), the prefix hit rate against the ideal (every token some earlier
request computed), and the later turns (2 on) whose prompt was found whole (all of the
ideal but the last block). Figures, not assertions (docs/benchmarks.md, "int8 KV").
"""

from __future__ import annotations

import argparse
import asyncio

from bench.kv_disk.common import add_common_args
from bench.kv_disk.working_set import one_run, session_size

BLOCK = 16


def summary(kv_dtype: str, run: dict, pool_bytes: int, tokens_per_session: int) -> str:
    rows, stats = run["rows"], run["stats"]
    blocks = run["blocks"]
    hit, ideal = sum(r["cached"] for r in rows), sum(r["ideal"] for r in rows)
    later = [r for r in rows if r["turn"] >= 1]
    whole = sum(r["cached"] >= r["ideal"] - BLOCK for r in later)
    return (
        f"| {kv_dtype} ({stats['kv_dtype']}) | {blocks} | {stats['block_bytes']:,} "
        f"| {blocks * BLOCK / pool_bytes * 2**20:.1f} "
        f"| {blocks * BLOCK / tokens_per_session:.1f} | {hit / max(1, ideal):.1%} "
        f"| {whole}/{len(later)} | {stats['evictions']['dropped']} |"
    )


async def main_async(args) -> None:
    tokens_per_session, block_bytes = await session_size(args)  # block: the model dtype's
    total_blocks = args.sessions * tokens_per_session // BLOCK
    pool_bytes = int(total_blocks * args.pool_fraction) * block_bytes
    print(
        f"model={args.model} sessions={args.sessions} turns={args.turns} "
        f"think_time={args.think_time}s ~{tokens_per_session} tokens/session: "
        f"{total_blocks} blocks in all in the model dtype; pool {pool_bytes:,} bytes "
        f"({args.pool_fraction:.0%} of them)\n"
    )
    head = (
        "| KV dtype | pool blocks | bytes per block | cached tokens per MiB "
        "| sessions held whole | hit rate of ideal | later turns found whole | blocks evicted |"
    )
    print(head)
    print("|---" * head.count(" |") + "|", flush=True)
    for kv_dtype in ("auto", "int8"):
        run = await one_run(args, None, None, kv_cache_bytes=pool_bytes, kv_dtype=kv_dtype)
        print(summary(kv_dtype, run, pool_bytes, tokens_per_session), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--think-time", type=float, default=5.0)
    parser.add_argument("--pool-fraction", type=float, default=0.25)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
