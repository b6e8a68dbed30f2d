"""KV memory over a run: what was allocated, what held real tokens, what a static
allocator would have needed.

Two sources:
- the client's own view, for every system: at time t each in-flight request holds its
  prompt plus the tokens generated so far (spread evenly between its first token and its
  end). A static allocator reserves, per in-flight request, the model's maximum length.
- ours only: ``GET /admin/cache`` sampled during the run, giving the token slots held by
  live sequences (allocated blocks x block size) and the tokens written into them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from bench.multiturn.client import RequestRecord


@dataclass
class AdminSampler:
    """Polls an admin endpoint every ``interval_s`` while a run is going on."""

    base_url: str
    path: str
    interval_s: float = 0.25
    samples: list[dict] = field(default_factory=list)
    errors: int = 0

    async def run(self, t0: float, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=5.0) as http:
            while not stop.is_set():
                try:
                    response = await http.get(self.path)
                    response.raise_for_status()
                    self.samples.append({"t": time.perf_counter() - t0, "body": response.json()})
                except (httpx.HTTPError, ValueError):
                    self.errors += 1
                try:
                    await asyncio.wait_for(stop.wait(), self.interval_s)
                except TimeoutError:
                    pass


def _find(tree: object, names: Sequence[str]) -> float | None:
    """First numeric value under any of ``names``, searching nested dicts breadth-first."""
    queue = [tree]
    while queue:
        node = queue.pop(0)
        if isinstance(node, dict):
            for name in names:
                value = node.get(name)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    return float(value)
            queue.extend(v for v in node.values() if isinstance(v, dict))
    return None


# Field names of ours' /admin/cache: {"engine": {"device": {"used": <blocks referenced by
# live sequences>, ...}, "block_size": int, "num_sequences": int, "used_token_slots"?: int}}.
# Slot-level usage is optional: without it only a bound on the waste is known.
ALLOCATED_SLOT_KEYS = ("allocated_token_slots", "allocated_slots")
USED_SLOT_KEYS = ("used_token_slots", "used_slots")
BLOCK_SIZE_KEYS = ("block_size",)


def slots_from_admin(body: dict, block_size: int = 16) -> tuple[float, float | None] | None:
    """(allocated token slots, used token slots or None) from one /admin/cache answer, or
    None when it reports no allocation. Allocated = blocks referenced by live sequences x
    block size (cached, unreferenced blocks are a cache, not an allocation)."""
    allocated = _find(body, ALLOCATED_SLOT_KEYS)
    if allocated is None:
        engine = body.get("engine", body) if isinstance(body, dict) else {}
        device = engine.get("device") if isinstance(engine, dict) else None
        blocks = device.get("used") if isinstance(device, dict) else None
        if not isinstance(blocks, int | float) or isinstance(blocks, bool):
            return None
        allocated = blocks * (_find(body, BLOCK_SIZE_KEYS) or block_size)
    return float(allocated), _find(body, USED_SLOT_KEYS)


def waste_bound_slots(body: dict, block_size: int = 16) -> float | None:
    """Most slots that can be allocated but empty when blocks are handed out as tokens
    arrive: each live sequence's last, partially filled block (block_size - 1 each)."""
    num_sequences = _find(body, ("num_sequences",))
    if num_sequences is None:
        return None
    return num_sequences * ((_find(body, BLOCK_SIZE_KEYS) or block_size) - 1)


@dataclass(frozen=True)
class MemorySummary:
    """Means over the samples where anything was allocated (an idle server wastes
    nothing). ``waste_pct`` is None when the server does not report used slots."""

    samples: int
    mean_allocated_slots: float
    mean_used_slots: float | None
    waste_pct: float | None
    peak_allocated_slots: float = 0.0
    waste_bound_pct: float | None = None


def summarize_admin(samples: Sequence[dict], block_size: int = 16) -> MemorySummary | None:
    """Waste = 1 - sum(used) / sum(allocated) over the busy samples; where used slots are
    not reported, ``waste_bound_pct`` bounds it from the live sequences' last blocks."""
    rows = []
    for sample in samples:
        pair = slots_from_admin(sample["body"], block_size)
        if pair is not None and pair[0] > 0:
            rows.append((*pair, waste_bound_slots(sample["body"], block_size)))
    if not rows:
        return None
    allocated = sum(a for a, _, _ in rows)
    peak = max(a for a, _, _ in rows)
    bound = None
    if all(b is not None for _, _, b in rows):
        bound = 100 * min(1.0, sum(b for _, _, b in rows) / allocated)
    if any(u is None for _, u, _ in rows):
        return MemorySummary(len(rows), allocated / len(rows), None, None, peak, bound)
    used = sum(u for _, u, _ in rows)
    return MemorySummary(
        len(rows),
        allocated / len(rows),
        used / len(rows),
        100 * (1 - used / allocated),
        peak,
        bound,
    )


def _tokens_held(record: RequestRecord, t: float) -> float:
    """Tokens a request holds at time t (0 outside its lifetime)."""
    if record.latency_s is None or record.prompt_tokens is None:
        return 0.0
    end = record.sent_at + record.latency_s
    if not record.sent_at <= t < end:
        return 0.0
    first = record.sent_at + (record.ttft_s if record.ttft_s is not None else record.latency_s)
    generated = record.completion_tokens or 0
    if t < first or end <= first:
        return float(record.prompt_tokens)
    return record.prompt_tokens + generated * (t - first) / (end - first)


def static_allocation(
    records: Sequence[RequestRecord], max_len: int, num_points: int = 200
) -> MemorySummary | None:
    """Client-side view: the tokens in-flight requests held, against ``max_len`` slots
    reserved per in-flight request, sampled at ``num_points`` even times over the run."""
    done = [r for r in records if r.ok and r.latency_s is not None]
    if not done or max_len < 1:
        return None
    start = min(r.sent_at for r in done)
    end = max(r.sent_at + r.latency_s for r in done)
    used_sum = reserved_sum = peak = 0.0
    counted = 0
    for i in range(num_points):
        t = start + (end - start) * (i + 0.5) / num_points
        held = [_tokens_held(r, t) for r in done]
        in_flight = sum(1 for h in held if h > 0)
        if in_flight:
            used_sum += sum(held)
            reserved_sum += in_flight * max_len
            peak = max(peak, in_flight * max_len)
            counted += 1
    if not counted:
        return None
    return MemorySummary(
        counted,
        reserved_sum / counted,
        used_sum / counted,
        100.0 * (1 - used_sum / reserved_sum),
        peak,
    )
