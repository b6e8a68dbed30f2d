"""Kill chatsvc with SIGKILL at random moments during streaming turns; check nothing acked is lost.

    python -m bench.reliability.crash_loop [--kills 20] [--conversations 4] [--seed 0]

One embedded Redis (AOF, fsync always) is started by this script and outlives
every service process. Each round: the conversations stream turns; once at
least one stream is mid-generation, the service is killed after a random
delay (at the next delta if that moment falls between turns); Redis is then
checked against what the clients saw (bench/reliability/history.py), and the
service is started again on the same Redis. At the end every conversation takes
one more turn. Exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.live_server import ProcessServer
from bench.reliability.history import Attempt, ConversationLog, verify
from bench.reliability.sse import stream_turn
from chatsvc.store import Store
from chatsvc.store.embedded import EmbeddedRedis

API_KEY = "crash-loop-tenant-key-0001"
TENANT = "crash"
PREFIX = "crashloop"
TOPICS = ("the sea", "bread", "winter", "trains", "bees", "maps", "clocks", "rivers")


@dataclass
class CrashReport:
    kills: int = 0
    acknowledged: int = 0
    committed_unacknowledged: int = 0
    streams_mid_generation_at_kill: list[int] = field(default_factory=list)
    restart_s: list[float] = field(default_factory=list)
    busy_wait_s: list[float] = field(default_factory=list)  # 409s waited out after a restart
    sessions: int = 0
    problems: list[str] = field(default_factory=list)

    def summary(self) -> str:
        mid = self.streams_mid_generation_at_kill
        return "\n".join(
            [
                f"kills: {self.kills}   sessions: {self.sessions}",
                f"acknowledged turns: {self.acknowledged}   committed but unacknowledged: "
                f"{self.committed_unacknowledged}",
                f"streams mid-generation at each kill: {mid} (total {sum(mid)})",
                f"restart to ready: max {max(self.restart_s, default=0):.1f} s",
                f"longest 409 wait after a restart (stale turn lock): "
                f"{max(self.busy_wait_s, default=0):.1f} s",
                f"problems: {len(self.problems)}",
                *(f"  - {p}" for p in self.problems),
            ]
        )


class Conversation:
    """One client: a chain of sessions (a new one when the context is full)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.logs: list[ConversationLog] = []
        self.turn = 0
        self.mid_stream = False  # a delta arrived and the stream has not ended

    @property
    def log(self) -> ConversationLog:
        return self.logs[-1]

    def next_text(self, rng: random.Random) -> str:
        self.turn += 1
        topic = rng.choice(TOPICS)
        return f"[c{self.index} t{self.turn} {uuid.uuid4().hex[:6]}] Say something about {topic}."


async def _new_session(http: httpx.AsyncClient, conv: Conversation) -> None:
    response = await http.post("/sessions", json={"system_prompt": "You are brief."})
    response.raise_for_status()
    conv.logs.append(ConversationLog(response.json()["id"]))


async def _converse(http, conv, rng, max_tokens, delta_seen, report, stop) -> None:
    """Stream turns until the service dies (or ``stop`` is set)."""
    busy_since = None
    while not stop.is_set():
        attempt = Attempt(conv.next_text(rng))

        def on_delta(_, conv=conv):
            conv.mid_stream = True
            delta_seen.set()

        body = {"content": attempt.user_text, "max_tokens": max_tokens, "temperature": 0.8}
        outcome = await stream_turn(http, conv.log.session_id, body, on_delta)
        conv.mid_stream = False
        if outcome.status == 409:
            busy_since = busy_since or time.monotonic()
            await asyncio.sleep(0.5)
            continue
        if busy_since is not None:
            report.busy_wait_s.append(time.monotonic() - busy_since)
            busy_since = None
        error_type = (outcome.error or {}).get("error", {}).get("type")
        if error_type == "context_length_exceeded":
            await _new_session(http, conv)
            continue
        conv.log.attempts.append(attempt)
        if outcome.acknowledged:
            if outcome.done["message"]["content"] != outcome.text:
                report.problems.append(f"{conv.log.session_id}: done differs from the deltas")
            attempt.answer = outcome.done["message"]["content"]
        elif outcome.transport_error is not None:
            return  # the service is gone; this attempt may or may not be stored
        elif outcome.status == 200:
            report.problems.append(f"{conv.log.session_id}: stream ended without done: {outcome}")


# How long a kill waits for some stream to be mid-generation after its delay.
MID_STREAM_WAIT_S = 10.0


async def _round(server, convs, rng, args, report) -> None:
    delta_seen, stop = asyncio.Event(), asyncio.Event()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120) as http:
        for conv in convs:
            if not conv.logs:
                await _new_session(http, conv)
        tasks = [
            asyncio.create_task(_converse(http, c, rng, args.max_tokens, delta_seen, report, stop))
            for c in convs
        ]
        await delta_seen.wait()
        await asyncio.sleep(rng.uniform(0, args.max_delay_s))
        # The delay picks the moment; if it falls between two turns of every
        # conversation (a reply done, the next not yet streaming), kill at the next
        # delta instead: a kill mid-generation is the case the check is about.
        deadline = time.monotonic() + MID_STREAM_WAIT_S
        while not any(c.mid_stream for c in convs) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        report.streams_mid_generation_at_kill.append(sum(c.mid_stream for c in convs))
        await asyncio.to_thread(server.kill)
        report.kills += 1
        stop.set()
        await asyncio.gather(*tasks)


async def _check(redis_url: str, convs: list[Conversation], report: CrashReport) -> None:
    store = await Store.connect(redis_url, prefix=PREFIX)
    try:
        tenant = await store.tenants.by_name(TENANT)
        for conv in convs:
            for log in conv.logs:
                verdict = await verify(store, tenant.id, log)
                report.problems += [f"{log.session_id}: {p}" for p in verdict.problems]
    finally:
        await store.close()


async def _final_turns(server, convs, report) -> None:
    """Every conversation continues with one more (non-streaming) turn."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=300) as http:
        for conv in convs:
            attempt = Attempt(f"[c{conv.index} final {uuid.uuid4().hex[:6]}] Thank you!")
            body = {"content": attempt.user_text, "max_tokens": 8, "temperature": 0}
            started = time.monotonic()
            response = await http.post(f"/sessions/{conv.log.session_id}/messages", json=body)
            while response.status_code == 409:  # the killed turn's lock runs out its TTL
                await asyncio.sleep(0.5)
                response = await http.post(f"/sessions/{conv.log.session_id}/messages", json=body)
            report.busy_wait_s.append(time.monotonic() - started)
            conv.log.attempts.append(attempt)
            if response.status_code != 200:
                report.problems.append(f"{conv.log.session_id}: cannot continue: {response.text}")
                continue
            attempt.answer = response.json()["message"]["content"]


def _start(server: ProcessServer, report: CrashReport) -> None:
    started = time.monotonic()
    server.start()
    report.restart_s.append(time.monotonic() - started)


async def run(args: argparse.Namespace, work_dir: Path) -> CrashReport:
    rng = random.Random(args.seed)
    report = CrashReport()
    convs = [Conversation(i) for i in range(args.conversations)]
    with EmbeddedRedis(work_dir / "redis", appendfsync="always") as redis_server:
        env = {
            "CHATSVC_REDIS_URL": redis_server.url,
            "CHATSVC_KEY_PREFIX": PREFIX,
            "CHATSVC_API_KEYS": f"{TENANT}:{API_KEY}",
            "CHATSVC_NUM_GPU_BLOCKS": "512",
            "CHATSVC_MAX_MODEL_LEN": "2048",
            "CHATSVC_MAX_TOKENS_CAP": str(max(64, args.max_tokens)),
            "CHATSVC_TURN_LOCK_TTL_S": str(args.turn_lock_ttl_s),
        }
        server = ProcessServer(env, work_dir / "chatsvc.log")
        try:
            for _ in range(args.kills):
                await asyncio.to_thread(_start, server, report)
                await _round(server, convs, rng, args, report)
                await _check(redis_server.url, convs, report)  # Redis alone, service dead
            await asyncio.to_thread(_start, server, report)
            await _final_turns(server, convs, report)
            await _check(redis_server.url, convs, report)
        finally:
            server.stop()
        store = await Store.connect(redis_server.url, prefix=PREFIX)
        try:
            tenant = await store.tenants.by_name(TENANT)
            for conv in convs:
                for log in conv.logs:
                    verdict = await verify(store, tenant.id, log)
                    report.acknowledged += log.num_acknowledged
                    report.committed_unacknowledged += verdict.committed_unacknowledged
                    report.sessions += 1
        finally:
            await store.close()
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-delay-s", type=float, default=4.0, help="after the first delta")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--turn-lock-ttl-s",
        type=int,
        default=30,
        help="the service's turn lock TTL (default 30, the service's own); a killed turn's "
        "lock is taken over sooner, once the killed instance's presence key lapses",
    )
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary dir")
    args = parser.parse_args(argv)
    if args.kills < 1 or args.conversations < 1 or args.max_tokens < 1 or args.max_delay_s < 0:
        parser.error("--kills, --conversations and --max-tokens must be >= 1, delays >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="crash-loop-") as tmp:
        work_dir = args.work_dir or Path(tmp)
        work_dir.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        report = asyncio.run(run(args, work_dir))
    print(report.summary())
    print(f"wall time: {time.monotonic() - started:.0f} s")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
