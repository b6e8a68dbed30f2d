"""What one DELETE /sessions/{id} costs against the number of the tenant's other sessions.

    python -m bench.delete_cost [--counts 0,20,50,100] [--history-tokens 2000] [--deletes 5]

An embedded Redis and the real app (in-process, the small default model). The
tenant's other sessions are written straight into the store (a user and an
assistant message of ``--history-tokens`` random tokens in all, no model run):
only their number and size matter to a delete. Each deleted session is real:
created over HTTP, one turn of one token, so its KV is in the cache to forget.
Prints the median and the worst DELETE time per count of other sessions; a
delete that costs O(its own blocks) stays flat as the count grows.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.live_server import ThreadServer, unique_prefix
from chatsvc.api.app import create_app
from chatsvc.config import Limits, Settings
from chatsvc.engine.config import EngineConfig
from chatsvc.store.embedded import EmbeddedRedis
from chatsvc.store.records import MessageRecord

KEY = "sk-bench-delete-cost-acme"
ADMIN = "sk-bench-delete-cost-admin"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.delete_cost", description=__doc__)
    p.add_argument("--counts", default="0,20,50,100", help="other sessions of the tenant")
    p.add_argument("--history-tokens", type=int, default=2000)
    p.add_argument("--deletes", type=int, default=5, help="DELETEs timed per count")
    return p.parse_args(argv)


def _settings(redis_url: str) -> Settings:
    return Settings(
        redis_url=redis_url,
        key_prefix=unique_prefix("delcost"),
        admin_key=ADMIN,
        api_keys=(("acme", KEY),),
        limits=Limits(max_tokens_cap=8),
        engine=EngineConfig(model="smollm2", block_size=16, num_gpu_blocks=512),
    )


def _other_session(live: ThreadServer, tenant_id: str, rng: random.Random, num_tokens: int):
    half = num_tokens // 2
    messages = [
        MessageRecord(role=role, text=role, token_ids=[rng.randrange(1, 49152) for _ in range(n)])
        for role, n in (("user", half), ("assistant", num_tokens - half))
    ]
    store = live.services.store
    live.call(store.sessions.create(tenant_id, None, None, None, None, messages=messages))


def _timed_delete(http: httpx.Client, n: int) -> float:
    session = http.post("/sessions", json={})
    session.raise_for_status()
    sid = session.json()["id"]
    turn = http.post(
        f"/sessions/{sid}/messages",
        json={"content": f"Delete me, number {n}.", "max_tokens": 1, "temperature": 0},
    )
    turn.raise_for_status()
    start = time.perf_counter()
    deleted = http.delete(f"/sessions/{sid}")
    elapsed = time.perf_counter() - start
    assert deleted.status_code == 204, deleted.text
    return elapsed * 1000


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    counts = sorted(int(c) for c in args.counts.split(","))
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp)) as redis_server:
        with ThreadServer(create_app(_settings(redis_server.url))) as live:
            tenant = live.call(live.services.store.tenants.by_name("acme"))
            headers = {"Authorization": f"Bearer {KEY}"}
            with httpx.Client(base_url=live.url, headers=headers, timeout=300) as http:
                _timed_delete(http, -1)  # warm-up: the first turn compiles and loads
                made = 0
                print(
                    f"other sessions   DELETE median ms   worst ms   ({args.history_tokens}"
                    f"-token histories, {args.deletes} deletes each)"
                )
                for count in counts:
                    while made < count:
                        _other_session(live, tenant.id, rng, args.history_tokens)
                        made += 1
                    times = [_timed_delete(http, i) for i in range(args.deletes)]
                    print(f"{count:>14}   {statistics.median(times):>17.1f}   {max(times):>8.1f}")


if __name__ == "__main__":
    main()
