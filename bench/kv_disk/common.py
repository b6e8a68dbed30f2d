"""What the disk-tier benchmarks share: engines, conversations, percentiles.

A conversation is driven through ``AsyncEngine`` like bench.engine does: the
prompt of turn n+1 is the exact tokens of turn n (prompt + answer) plus the new
turn's, so every turn can reuse everything before it. A "restart" is a new
AsyncEngine (empty memory tiers) on the same disk directory: the model load is
left out of the figures, the disk index rebuild is in them (it runs at start).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from cache import Namespace
from chatsvc.engine import AsyncEngine, EngineConfig
from chatsvc.protocol import GenerationRequest, SamplingParams

SYSTEM = (
    "You are a patient assistant for a travel company. Answer in detail but stay on "
    "topic, never invent prices, and end with one concrete next step. "
)
TOPICS = ["Lisbon", "Kyoto", "Oslo", "Lima", "Cairo", "Hanoi", "Quebec", "Perth"]


def question(conv: int, turn: int, words: int) -> str:
    """A user turn of about ``words`` words, different per conversation and turn."""
    topic = TOPICS[conv % len(TOPICS)]
    filler = " ".join(f"detail{(conv * 31 + turn * 7 + i) % 97}" for i in range(words))
    return f"Trip {conv}, question {turn + 1} about {topic}: please cover {filler}."


@dataclass
class Conversation:
    """One session: its namespace, tokens so far, and per-turn records."""

    conv: int
    namespace: Namespace
    history: list[int] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)


def new_conversations(engine: AsyncEngine, count: int, system_repeat: int) -> list[Conversation]:
    fmt = engine.chat_format
    system = fmt.tokenize(f"<|im_start|>system\n{SYSTEM * system_repeat}<|im_end|>\n")
    out = []
    for conv in range(count):
        # One tenant per conversation keeps histories private (as sessions are);
        # the system prompt is shared (public) like a registered shared prompt.
        ns = Namespace(tenant_salt=f"t{conv}".encode(), shared_prefix_len=len(system))
        out.append(Conversation(conv, ns, list(system)))
    return out


async def run_turn(
    engine, conv: Conversation, turn: int, args, tag: str = "", variant: int = 0
) -> dict:
    """One turn of ``conv``; ``variant`` > 0 asks another question at the same turn."""
    fmt = engine.chat_format
    text = question(conv.conv, turn + 1000 * variant, args.question_words)
    prompt = conv.history + fmt.tokenize(
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )
    params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=0.0)
    request = GenerationRequest(f"{tag}c{conv.conv}-t{turn}", prompt, params, conv.namespace)
    start = time.perf_counter()
    first = None
    output: list[int] = []
    metrics = None
    async for delta in engine.generate(request):
        if first is None:
            first = time.perf_counter()
        output += delta.token_ids
        if delta.metrics is not None:
            metrics = delta.metrics
    end_turn = fmt.tokenize("<|im_end|>\n")
    computed = len(prompt) + len(output) - 1  # the last sampled token has no KV yet
    if output[-1] != end_turn[0]:
        output.append(end_turn[0])
    conv.history = prompt + output + end_turn[1:]
    row = {
        "turn": turn,
        "ttft": first - start,
        "prompt": len(prompt),
        "computed": computed,
        "cached": metrics.cached_prompt_tokens,
        "by_tier": dict(metrics.cached_tokens_by_tier),
    }
    conv.rows.append(row)
    return row


def engine_config(args, **overrides) -> EngineConfig:
    values = dict(
        model=args.model,
        dtype=args.dtype,
        max_num_batched_tokens=args.batch_tokens,
        num_threads=args.threads,
    )
    if args.kv_disk_bytes is not None:
        values["kv_disk_bytes"] = args.kv_disk_bytes
    if args.load_threads is not None:
        values["kv_disk_load_threads"] = args.load_threads
    if args.kv_cache_bytes is not None:
        values["kv_cache_bytes"] = args.kv_cache_bytes
    if args.warm_up_s is not None:
        values["warm_up_s"] = args.warm_up_s
    values.update(overrides)
    return EngineConfig(**values)


async def started(config: EngineConfig) -> AsyncEngine:
    """A started engine, warmed up as the service warms it before it says ready."""
    return (await started_timed(config))[0]


async def started_timed(config: EngineConfig) -> tuple[AsyncEngine, float, float]:
    """``started`` and its seconds: (engine, start incl. the disk index rebuild, warm-up)."""
    engine = AsyncEngine(config)
    began = time.perf_counter()
    await engine.start()
    loaded = time.perf_counter()
    await engine.warm_up()
    return engine, loaded - began, time.perf_counter() - loaded


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def p50(values):
    return statistics.median(values) if values else float("nan")


def pause(rng: random.Random, think_time: float) -> float:
    return rng.uniform(0, think_time) if think_time else 0.0


async def settle(engine: AsyncEngine) -> None:
    """Wait until the disk tier has written what was queued (between benchmark phases)."""
    while True:
        disk = engine.cache_stats().get("disk") or {}
        if not disk.get("queued_jobs") and not disk.get("writing"):
            return
        await asyncio.sleep(0.05)


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


async def preloaded(engine, timeout_s: float = 600.0) -> dict:
    """Wait until the engine's preload ended (it reads while the engine is idle); its
    statistics."""
    deadline = time.perf_counter() + timeout_s
    while (preload := engine.cache_stats()["disk"].get("preload", {})).get("state") == "running":
        if time.perf_counter() > deadline:
            raise TimeoutError(f"the preload did not end in {timeout_s:.0f} s: {preload}")
        await asyncio.sleep(0.02)
    return preload


def add_common_args(parser) -> None:
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64, help="answer length cap")
    parser.add_argument(
        "--min-tokens", type=int, default=0, help="answer length floor (end-of-turn waits)"
    )
    parser.add_argument("--question-words", type=int, default=60, help="~1.5 tokens each")
    parser.add_argument("--system-repeat", type=int, default=6, help="~30 tokens each")
    parser.add_argument("--kv-dir", default=None, help="default: a temporary directory")
    parser.add_argument(
        "--kv-disk-bytes",
        type=int,
        default=None,
        help="disk tier budget (default: the tier's automatic one, a share of the free space)",
    )
    parser.add_argument(
        "--warm-up-s",
        type=float,
        default=None,
        help="the engines' warm-up budget before the first request (default: the "
        "service's, CHATSVC_WARM_UP_S; 0: none, the engine as before the warm-up)",
    )
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="device pool bytes (default 1 GiB: 2,880 blocks in bf16, half that in fp32)",
    )
    parser.add_argument(
        "--load-threads", type=int, default=None, help="disk tier load threads (default: 2)"
    )
