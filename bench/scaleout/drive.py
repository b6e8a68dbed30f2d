"""Clients for the scale-out benches: the multi-turn workload over a fleet, and its figures.

Two ways to hold a conversation:

- ``chat_workload``: the OpenAI-compatible API, the whole history resent each
  turn (bench.multiturn's client); with ``session_header`` every request carries
  ``X-Session-Id: <conversation id>`` and nginx hashes on it, without it nginx
  goes round-robin. The replicas and nginx are the same in both runs.
- ``SessionConversation``: the sessions API (the history lives in Redis, turns
  stream over SSE), for the benches that check Redis afterwards.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from bench.multiturn.client import RequestRecord, ServerError, stream_chat
from bench.multiturn.report import percentile
from bench.multiturn.workload import Conversation, Workload
from bench.reliability.history import Attempt, ConversationLog
from bench.reliability.sse import StreamOutcome, stream_turn


def tenant_keys(workload: Workload) -> dict[str, str]:
    """One API key per tenant of the workload (the fleet registers them at start)."""
    return {
        t: f"{t}-scaleout-bench-key" for t in sorted({c.tenant for c in workload.conversations})
    }


async def chat_workload(
    base_url: str,
    workload: Workload,
    keys: dict[str, str],
    *,
    model: str,
    session_header: bool,
    concurrency: int,
    label: str,
) -> list[RequestRecord]:
    """Every conversation of ``workload``, ``concurrency`` at a time; their request records."""
    gate = asyncio.Semaphore(concurrency)
    records: list[RequestRecord] = []
    t0 = time.perf_counter()

    async def converse(conv: Conversation) -> None:
        headers = {"Authorization": f"Bearer {keys[conv.tenant]}"}
        if session_header:
            headers["X-Session-Id"] = conv.conversation_id
        async with (
            gate,
            httpx.AsyncClient(
                base_url=base_url, headers=headers, timeout=httpx.Timeout(600, connect=10)
            ) as http,
        ):
            messages = [{"role": "system", "content": conv.system_prompt}]
            for turn, text in enumerate(conv.user_turns):
                if conv.think_times_s[turn] > 0:
                    await asyncio.sleep(conv.think_times_s[turn])
                messages.append({"role": "user", "content": text})
                record = RequestRecord(
                    label, conv.conversation_id, turn, 0.0, max_tokens=conv.answer_tokens[turn]
                )
                records.append(record)
                try:
                    await stream_chat(http, list(messages), record, model, t0)
                except (ServerError, httpx.HTTPError, ValueError) as exc:
                    record.error = f"{type(exc).__name__}: {exc}"
                    return
                messages.append({"role": "assistant", "content": record.answer})

    await asyncio.gather(*(converse(c) for c in workload.conversations))
    records.sort(key=lambda r: r.sent_at)
    return records


def figures(records: list[RequestRecord], from_turn: int = 2) -> dict:
    """Hit rate and TTFT over turns ``from_turn`` and later (0-based: 2 = the third turn)."""
    ok = [r for r in records if r.ok]
    later = [r for r in ok if r.turn >= from_turn and r.prompt_tokens]
    prompt = sum(r.prompt_tokens or 0 for r in later)
    cached = sum(r.cached_tokens or 0 for r in later)
    ttfts = [r.ttft_s for r in later if r.ttft_s is not None]
    span = max(r.sent_at + (r.latency_s or 0) for r in ok) - min(r.sent_at for r in ok) if ok else 0
    return {
        "requests": len(records),
        "errors": sum(1 for r in records if r.error),
        "hit_rate_from_turn_3": cached / prompt if prompt else None,
        "ttft_p50_from_turn_3_s": percentile(ttfts, 50),
        "ttft_p95_from_turn_3_s": percentile(ttfts, 95),
        "requests_per_s": len(ok) / span if span else None,
        "completion_tokens_per_s": sum(r.completion_tokens or 0 for r in ok) / span
        if span
        else None,
    }


@dataclass
class TurnRecord:
    """One streamed session turn as the client saw it; ``at`` is monotonic time at send."""

    turn: int
    at: float
    outcome: StreamOutcome


@dataclass
class SessionConversation:
    """A workload conversation held on the sessions API; ``log`` is what Redis must hold."""

    conv: Conversation
    http: httpx.AsyncClient
    session_id: str = ""
    log: ConversationLog | None = None
    turns: list[TurnRecord] = field(default_factory=list)
    mid_stream: bool = False

    async def open(self) -> None:
        response = await self.http.post(
            "/sessions", json={"system_prompt": self.conv.system_prompt}
        )
        response.raise_for_status()
        self.session_id = response.json()["id"]
        self.log = ConversationLog(self.session_id)

    async def turn(
        self, index: int, on_delta=None, retry_busy_s: float = 60.0, max_tokens: int | None = None
    ) -> TurnRecord:
        """Send user turn ``index`` (waiting out 409s); logs the attempt for the Redis check."""
        turns = self.conv.user_turns
        attempt = Attempt(f"[t{index}] {turns[index % len(turns)]}")
        if max_tokens is None:
            max_tokens = self.conv.answer_tokens[index % len(turns)]
        body = {"content": attempt.user_text, "max_tokens": max_tokens, "temperature": 0}
        deadline = time.monotonic() + retry_busy_s

        def delta(outcome: StreamOutcome) -> None:
            self.mid_stream = True
            if on_delta is not None:
                on_delta(self)

        while True:
            at = time.monotonic()
            outcome = await stream_turn(self.http, self.session_id, body, delta)
            self.mid_stream = False
            if outcome.status != 409 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        if outcome.status != 409:
            self.log.attempts.append(attempt)
        if outcome.acknowledged:
            attempt.answer = outcome.done["message"]["content"]
        record = TurnRecord(index, at, outcome)
        self.turns.append(record)
        return record
