"""A page of a conversation's items against the bytes the conversation stores.

    .venv/bin/python -m bench.store_paging [--sizes-mb 1 4 16] [--reads 30]

For each size, one session is filled with that many bytes of 32,000-character
items through the store (no model), then ``GET /v1/conversations/{id}/items
?limit=1`` is timed as the store serves it: the median of ``--reads`` calls.
With the store's paging (``store.tree.page``) that is an LRANGE and an HMGET
of the one item; a tree without it reads the whole branch and pages in Python,
as the handler did, and the script measures that there, so the same command
gives the before and after figures (docs/benchmarks.md). Figures, not
assertions; an embedded Redis of its own in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.live_server import unique_prefix
from chatsvc.store import Store
from chatsvc.store.embedded import EmbeddedRedis
from chatsvc.store.records import MessageRecord

ITEM_CHARS = 32_000


async def _newest_item(store: Store, tenant_id: str, session_id: str) -> MessageRecord:
    """What items?limit=1 (newest first) reads from the store."""
    if hasattr(store.tree, "page"):
        page = await store.tree.page(tenant_id, session_id, limit=1, order="desc")
        return page.messages[0]
    branch = await store.tree.branch(tenant_id, session_id)
    return branch.messages[::-1][:1][0]


async def _run(url: str, sizes_mb: list[int], reads: int) -> list[tuple[int, int, float]]:
    store = await Store.connect(url, prefix=unique_prefix("bench"))
    try:
        tenant = await store.tenants.ensure("bench")
        rows = []
        for size in sizes_mb:
            count = max(1, size * 2**20 // ITEM_CHARS)
            items = [
                MessageRecord(role="user", text=f"{i:08d}".ljust(ITEM_CHARS, "x"), token_ids=[])
                for i in range(count)
            ]
            session = await store.sessions.create(tenant.id, None, None, None, {}, messages=items)
            timings = []
            for _ in range(reads):
                start = time.perf_counter()
                newest = await _newest_item(store, tenant.id, session.id)
                timings.append(time.perf_counter() - start)
            assert newest.text == items[-1].text
            rows.append((size, count, statistics.median(timings) * 1000))
        return rows
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--reads", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp)) as server:
        rows = asyncio.run(_run(server.url, args.sizes_mb, args.reads))
    print("| stored | items | items?limit=1, median ms |")
    print("|---:|---:|---:|")
    for size, count, ms in rows:
        print(f"| {size} MB | {count} | {ms:.2f} |")


if __name__ == "__main__":
    main()
