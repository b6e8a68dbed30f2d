"""Soak: N concurrent streaming conversations for M minutes, then idle; look for leaks.

    python -m bench.reliability.soak --streams 32 --minutes 10 [--out soak.json]

Starts an embedded Redis and ``python -m chatsvc serve`` (a child process), runs
the conversations (each a chain of sessions: a new one when the context is
full), samples the service's RSS from /proc/<pid>/status, and reports per
minute: turns, errors, client-side TTFT p50/p99, RSS. Then every client stops
(streams in flight are cut, as disconnecting clients do), the service idles,
and /admin/cache must show no block in use (every device block free or
cached), no live sequence, and ``integrity: ok``. Exit status 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.live_server import ProcessServer
from bench.reliability.crash_loop import TOPICS
from bench.reliability.sse import stream_turn
from chatsvc.store.embedded import EmbeddedRedis

API_KEY = "soak-tenant-key-00000001"
ADMIN_KEY = "soak-admin-key-000000001"
SAMPLE_EVERY_S = 5.0


@dataclass
class TurnSample:
    at_s: float  # since the start of the run
    ttft_s: float | None
    ok: bool
    error: str | None = None


@dataclass
class SoakReport:
    streams: int
    minutes: float
    turns: list[TurnSample] = field(default_factory=list)
    rss_mb: list[tuple[float, float]] = field(default_factory=list)
    idle_cache: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _conversation(http, index, rng, stop, t0, report, max_tokens) -> None:
    session_id, turn = None, 0
    while not stop.is_set():
        if session_id is None:
            response = await http.post("/sessions", json={"system_prompt": "You are brief."})
            response.raise_for_status()
            session_id = response.json()["id"]
        turn += 1
        text = f"[s{index} t{turn}] Tell me one fact about {rng.choice(TOPICS)}."
        body = {"content": text, "max_tokens": max_tokens, "temperature": 0.7}
        outcome = await stream_turn(http, session_id, body)
        error = (outcome.error or {}).get("error", {}).get("type") or outcome.transport_error
        if error == "context_length_exceeded":
            session_id = None
            continue
        at = time.monotonic() - t0
        report.turns.append(TurnSample(at, outcome.ttft_s, outcome.acknowledged, error))


async def _sample_rss(pid, stop, t0, report) -> None:
    while not stop.is_set():
        report.rss_mb.append((time.monotonic() - t0, rss_mb(pid)))
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
        except TimeoutError:
            pass


def _check_idle(cache: dict, report: SoakReport) -> None:
    engine = cache.get("engine", {})
    device = engine.get("device", {})
    if cache.get("integrity") != "ok":
        report.problems.append(f"integrity: {cache.get('integrity', 'not reported')}")
    if device.get("used") != 0:
        report.problems.append(f"{device.get('used')} device blocks still referenced when idle")
    if device.get("free", 0) + device.get("cached", 0) != device.get("total"):
        report.problems.append(f"device blocks are neither free nor cached: {device}")
    for key in ("num_sequences", "pending_blocks"):
        if engine.get(key):
            report.problems.append(f"{key} = {engine[key]} when idle")


async def run(args: argparse.Namespace, work_dir: Path) -> SoakReport:
    report = SoakReport(args.streams, args.minutes)
    rng = random.Random(args.seed)
    with EmbeddedRedis(work_dir / "redis", appendfsync="everysec") as redis_server:
        env = {
            "CHATSVC_REDIS_URL": redis_server.url,
            "CHATSVC_API_KEYS": f"soak:{API_KEY}",
            "CHATSVC_ADMIN_KEY": ADMIN_KEY,
            "CHATSVC_NUM_GPU_BLOCKS": str(args.gpu_blocks),
            "CHATSVC_NUM_HOST_BLOCKS": str(args.host_blocks),
            "CHATSVC_MAX_MODEL_LEN": str(args.max_model_len),
            "CHATSVC_MAX_TOKENS_CAP": str(max(64, args.max_tokens)),
            "CHATSVC_MAX_STREAMS_PER_TENANT": str(args.streams),
        }
        server = ProcessServer(env, work_dir / "chatsvc.log")
        await asyncio.to_thread(server.start)
        try:
            await _drive(server, args, rng, report)
        finally:
            server.stop()
    return report


async def _drive(server, args, rng, report) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    limits = httpx.Limits(max_connections=args.streams + 4)
    stop, t0 = asyncio.Event(), time.monotonic()
    async with httpx.AsyncClient(
        base_url=server.url, headers=headers, timeout=600, limits=limits
    ) as http:
        sampler = asyncio.create_task(_sample_rss(server.process.pid, stop, t0, report))
        tasks = [
            asyncio.create_task(_conversation(http, i, rng, stop, t0, report, args.max_tokens))
            for i in range(args.streams)
        ]
        await asyncio.sleep(args.minutes * 60)
        stop.set()
        for task in tasks:  # cut streams in flight, as clients that go away do
            task.cancel()
        await asyncio.gather(*tasks, sampler, return_exceptions=True)
    await asyncio.sleep(args.idle_s)
    report.rss_mb.append((time.monotonic() - t0, rss_mb(server.process.pid)))
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(base_url=server.url, headers=admin, timeout=120) as http:
        response = await http.get("/admin/cache")
        response.raise_for_status()
        report.idle_cache = response.json()
    _check_idle(report.idle_cache, report)


def summary(report: SoakReport, warmup_min: float) -> str:
    lines = ["minute  turns  errors  ttft_p50_s  ttft_p99_s  rss_mb"]
    for minute in range(int(report.minutes + 0.999)):
        turns = [t for t in report.turns if minute * 60 <= t.at_s < (minute + 1) * 60]
        ttfts = [t.ttft_s for t in turns if t.ttft_s is not None]
        rss = [mb for at, mb in report.rss_mb if at < (minute + 1) * 60]
        lines.append(
            f"{minute + 1:>6}  {len(turns):>5}  {sum(not t.ok for t in turns):>6}  "
            f"{percentile(ttfts, 0.5):>10.2f}  {percentile(ttfts, 0.99):>10.2f}  "
            f"{rss[-1] if rss else float('nan'):>6.0f}"
        )
    after = [mb for at, mb in report.rss_mb if at >= warmup_min * 60]
    if after:
        lines.append(
            f"RSS after {warmup_min:g} min warm-up: first {after[0]:.0f} MB, max {max(after):.0f}"
            f" MB, last (idle) {after[-1]:.0f} MB, growth {max(after) - after[0]:+.0f} MB"
        )
    errors = sorted({t.error for t in report.turns if t.error})
    lines.append(f"error kinds: {errors or 'none'}")
    device = report.idle_cache.get("engine", {}).get("device", {})
    lines.append(f"idle device blocks: {device}; integrity: {report.idle_cache.get('integrity')}")
    lines.append(f"problems: {report.problems or 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--gpu-blocks", type=int, default=1024)
    parser.add_argument(
        "--max-model-len", type=int, default=2048, help="a conversation starts a new session here"
    )
    parser.add_argument("--host-blocks", type=int, default=256)
    parser.add_argument("--warmup-minutes", type=float, default=2)
    parser.add_argument("--idle-s", type=float, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the raw figures as JSON")
    args = parser.parse_args(argv)
    if min(args.streams, args.max_tokens, args.max_model_len) < 1 or args.minutes <= 0:
        parser.error("--streams, --minutes, --max-tokens and --max-model-len must be positive")
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        report = asyncio.run(run(args, Path(tmp)))
    print(summary(report, args.warmup_minutes))
    if args.out is not None:
        args.out.write_text(json.dumps(asdict(report), indent=1))
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
