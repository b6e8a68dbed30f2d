"""Bounded cost: each endpoint's largest allowed request beside another tenant's greedy stream.

    python -m bench.reliability.bounded_cost [--max-gap-s 0.5] [--endpoints a,b] [--smoke]

Starts an embedded Redis and ``python -m chatsvc serve`` (the real model, in fp32:
greedy tokens are then the same whatever shares the batch) with two tenants and
the limits given here. The *witness* tenant holds a greedy multi-turn
conversation, streamed over SSE on the native API: first alone (its reference
answers), then once per endpoint while the *attacker* tenant sends that
endpoint's largest request the limits allow (bench/reliability/largest_requests.py),
``--concurrency`` at a time, until the witness's conversation ends. Between
endpoints the attacker's sessions are deleted, unmeasured.

Per endpoint it prints the attacker's requests and their statuses, the witness's
inter-token gaps (seconds between SSE deltas, client-side; max and p99, and
whether the max stayed under ``--max-gap-s``: a figure, not a check) and whether
every answer is byte-identical to the reference. Exit status 1 when an answer
differs, a witness turn fails, or an attacker request got a 5xx or no answer.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import httpx

from bench.live_server import ProcessServer
from bench.reliability.largest_requests import ENDPOINTS, Attacker, PatientTransport
from bench.reliability.soak import percentile
from bench.reliability.sse import stream_turn
from chatsvc.config import ENV_PREFIX, Limits
from chatsvc.store.embedded import EmbeddedRedis

WITNESS_KEY = "bounded-cost-witness-key-01"
ATTACKER_KEY = "bounded-cost-attacker-key-02"
WITNESS_SYSTEM = "You are a patient teacher."
WITNESS_TURNS = (
    "Explain in a few sentences how a river shapes its valley.",
    "Now tell me how glaciers do it differently.",
    "Which of the two is faster?",
)
# How long the attacker runs alone before the witness starts: its first requests are
# in the engine when the witness's first token is due.
HEAD_START_S = 0.5


@dataclass
class WitnessRun:
    answers: list[str] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)  # between consecutive deltas of a turn
    problems: list[str] = field(default_factory=list)


@dataclass
class EndpointRow:
    endpoint: str
    shape: str
    witness: WitnessRun
    statuses: dict[int, int]
    attacker_problems: list[str]
    wall_s: float


def limits_env(limits: Limits) -> dict[str, str]:
    """The ``CHATSVC_*`` variables that start the service with exactly ``limits``."""
    return {f"{ENV_PREFIX}{f.name.upper()}": str(getattr(limits, f.name)) for f in fields(limits)}


async def witness_conversation(
    http: httpx.AsyncClient, turns: tuple[str, ...], max_tokens: int
) -> WitnessRun:
    run = WitnessRun()
    response = await http.post("/sessions", json={"system_prompt": WITNESS_SYSTEM})
    response.raise_for_status()
    session_id = response.json()["id"]
    for text in turns:
        arrivals: list[float] = []
        body = {"content": text, "max_tokens": max_tokens, "temperature": 0}
        outcome = await stream_turn(
            http,
            session_id,
            body,
            on_delta=lambda _, seen=arrivals: seen.append(time.perf_counter()),
        )
        run.gaps_s += [
            later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)
        ]
        if not outcome.acknowledged:
            error = outcome.error or outcome.transport_error
            run.problems.append(f"turn {text!r} not acknowledged: {outcome.status} {error}")
        run.answers.append(outcome.text)
    return run


async def _attack(attacker: Attacker, endpoint: str, stop: asyncio.Event) -> None:
    unit = attacker.unit(endpoint)
    try:
        while not stop.is_set():
            await unit()
    except Exception as exc:  # noqa: BLE001 - an answer this client cannot read is a finding
        attacker.problems.append(f"{endpoint}: the attacker stopped: {type(exc).__name__}: {exc}")


async def measure(
    endpoint: str,
    attackers: list[Attacker],
    witness_http: httpx.AsyncClient,
    args: argparse.Namespace,
    patience: PatientTransport,
) -> EndpointRow:
    for attacker in attackers:
        attacker.problems.clear()
    patience.patient = True
    await attackers[0].prepare(endpoint)
    patience.patient = False
    for attacker in attackers[1:]:
        attacker.chat_chars = attackers[0].chat_chars
        attacker.prompts, attacker.prompt_len = attackers[0].prompts, attackers[0].prompt_len
        attacker.long_session_id = attackers[0].long_session_id
    for attacker in attackers:  # the set-up's requests are not the attack's
        attacker.statuses.clear()
    stop = asyncio.Event()
    started = time.monotonic()
    tasks = [asyncio.create_task(_attack(a, endpoint, stop)) for a in attackers]
    await asyncio.sleep(HEAD_START_S)
    witness = await witness_conversation(witness_http, args.turns, args.witness_tokens)
    stop.set()
    await asyncio.gather(*tasks)  # requests in flight finish and are counted
    wall = time.monotonic() - started
    statuses: dict[int, int] = {}
    problems: list[str] = []
    for attacker in attackers:
        for status, count in attacker.statuses.items():
            statuses[status] = statuses.get(status, 0) + count
        problems += attacker.problems
    patience.patient = True
    await attackers[0].clear()
    patience.patient = False
    shape = attackers[0].shape(endpoint)
    return EndpointRow(endpoint, shape, witness, statuses, problems, wall)


async def run(args: argparse.Namespace, work_dir: Path) -> tuple[WitnessRun, list[EndpointRow]]:
    with EmbeddedRedis(work_dir / "redis", appendfsync="everysec") as redis_server:
        env = {
            **limits_env(args.limits),
            "CHATSVC_REDIS_URL": redis_server.url,
            "CHATSVC_API_KEYS": f"witness:{WITNESS_KEY},attacker:{ATTACKER_KEY}",
            "CHATSVC_DTYPE": "fp32",
            "CHATSVC_MAX_MODEL_LEN": str(args.max_model_len),
            "CHATSVC_NUM_GPU_BLOCKS": str(args.gpu_blocks),
            "CHATSVC_MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
        }
        server = ProcessServer(env, work_dir / "chatsvc.log")
        await asyncio.to_thread(server.start)
        try:
            return await _drive(server.url, args)
        finally:
            server.stop()


async def _drive(url: str, args: argparse.Namespace) -> tuple[WitnessRun, list[EndpointRow]]:
    def client(key: str, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=600,
            transport=transport,
        )

    patience = PatientTransport()
    async with (
        client(WITNESS_KEY) as witness_http,
        client(ATTACKER_KEY, patience) as attacker_http,
    ):
        model = (await attacker_http.get("/v1/models")).json()["data"][0]["id"]
        attackers = [
            Attacker(attacker_http, args.limits, args.max_model_len, model, seed)
            for seed in range(args.concurrency)
        ]
        # Twice alone: the second run reads its prefixes from the cache, as the measured
        # runs do, and is the reference; the two must agree (fp32 greedy decoding).
        first = await witness_conversation(witness_http, args.turns, args.witness_tokens)
        solo = await witness_conversation(witness_http, args.turns, args.witness_tokens)
        solo.problems += first.problems
        if first.answers != solo.answers:
            solo.problems.append(f"alone, the answers differ between runs: {first.answers!r}")
        rows = [await measure(e, attackers, witness_http, args, patience) for e in args.endpoints]
    return solo, rows


def _gap_cells(gaps: list[float], bound: float) -> str:
    if not gaps:
        return f"{'-':>9}  {'-':>9}  {'-':>5}"
    top = max(gaps)
    verdict = "pass" if top <= bound else "FAIL"
    return f"{top:>9.3f}  {percentile(gaps, 0.99):>9.3f}  {verdict:>5}"


def summary(solo: WitnessRun, rows: list[EndpointRow], bound: float) -> tuple[str, bool]:
    """The table, and whether every check (not the gap bound) held."""
    ok = not solo.problems
    lines = [
        f"{'endpoint':<19} {'sent':>5}  {'statuses':<28} {'gap_max_s':>9}  {'gap_p99_s':>9}  "
        f"{'<=' + format(bound, 'g'):>5}  identical  wall_s",
        f"{'(witness alone)':<19} {'-':>5}  {'-':<28} {_gap_cells(solo.gaps_s, bound)}  "
        f"{'-':>9}  {'-':>6}",
    ]
    for row in rows:
        identical = row.witness.answers == solo.answers and not row.witness.problems
        ok = ok and identical and not row.attacker_problems
        statuses = " ".join(f"{s}:{n}" for s, n in sorted(row.statuses.items())) or "-"
        lines.append(
            f"{row.endpoint:<19} {sum(row.statuses.values()):>5}  {statuses:<28} "
            f"{_gap_cells(row.witness.gaps_s, bound)}  {'yes' if identical else 'NO':>9}  "
            f"{row.wall_s:>6.0f}"
        )
    for row in rows:
        lines.append(f"  {row.endpoint}: {row.shape}")
    for row in rows:
        for problem in row.witness.problems + row.attacker_problems[:5]:
            lines.append(f"  {row.endpoint}: {problem}")
        if row.witness.answers != solo.answers:
            lines.append(f"  {row.endpoint}: answers {row.witness.answers!r}")
    if solo.problems:
        lines += [f"  alone: {p}" for p in solo.problems]
    lines.append(f"reference answers: {solo.answers!r}")
    return "\n".join(lines), ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.reliability.bounded_cost", description=__doc__
    )
    p.add_argument("--endpoints", default=",".join(ENDPOINTS), help="comma-separated, in order")
    p.add_argument("--max-gap-s", type=float, default=0.5, help="the gap bound reported")
    p.add_argument("--turns", type=int, default=2, help="witness turns per conversation")
    p.add_argument("--witness-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=None, help="default: the tenant's streams")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-blocks", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="the prefill chunk")
    p.add_argument("--smoke", action="store_true", help="one endpoint, one short witness turn")
    p.add_argument("--work-dir", type=Path, default=None, help="keep Redis and the log here")
    defaults = Limits(
        max_body_bytes=64_000,
        max_message_chars=2_000,
        max_messages=32,
        max_tokens_cap=48,
        max_n=2,
        max_sessions_per_tenant=64,
        max_messages_per_session=200,
        max_session_bytes=256 * 1024,
        max_tenant_bytes=4 * 2**20,
        max_streams_per_tenant=2,
    )
    for f in fields(Limits):
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(flag, type=int, default=getattr(defaults, f.name), help="a limit")
    args = p.parse_args(argv)
    args.limits = Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
    args.limits.validate()
    if args.smoke:
        args.endpoints, args.turns, args.witness_tokens = "chat_completions", 1, 16
    args.endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    unknown = sorted(set(args.endpoints) - set(ENDPOINTS))
    if unknown:
        p.error(f"unknown endpoints {unknown}; known: {', '.join(ENDPOINTS)}")
    if not 1 <= args.turns <= len(WITNESS_TURNS):
        p.error(f"--turns must be 1..{len(WITNESS_TURNS)}")
    args.turns = WITNESS_TURNS[: args.turns]
    args.concurrency = args.concurrency or args.limits.max_streams_per_tenant
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bounded-cost-") as tmp:
        work_dir = args.work_dir or Path(tmp)
        work_dir.mkdir(parents=True, exist_ok=True)
        solo, rows = asyncio.run(run(args, work_dir))
    table, ok = summary(solo, rows, args.max_gap_s)
    limits = ", ".join(f"{k}={v}" for k, v in vars(args.limits).items())
    print(f"limits: {limits}; max_model_len={args.max_model_len}")
    print(table)
    print(f"wall time: {time.monotonic() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
