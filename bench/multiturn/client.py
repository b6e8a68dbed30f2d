"""One async client that drives any OpenAI-compatible ``/v1/chat/completions`` server.

Every conversation resends its whole history with the real previous answers, as chat
frontends do, so a server's prefix cache is what decides how much of it is recomputed.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from bench.multiturn.workload import Conversation, Workload


class ServerError(RuntimeError):
    """The server answered with an HTTP error or an error event in the stream."""


@dataclass
class RequestRecord:
    """What one request cost, as seen from the client. Times are seconds; ``sent_at`` and
    ``first_token_at`` are relative to the start of the run."""

    system: str
    conversation_id: str
    turn: int
    sent_at: float
    ttft_s: float | None = None
    latency_s: float | None = None
    tpot_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    max_tokens: int = 0
    finish_reason: str | None = None
    answer: str = ""
    error: str | None = None
    # Still running when the run's deadline cut it off: neither a success nor an error.
    cut_at_deadline: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cut_at_deadline


@dataclass
class RunResult:
    system: str
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    truncated: bool = False

    def to_json(self) -> dict:
        return {
            "system": self.system,
            "wall_s": self.wall_s,
            "truncated": self.truncated,
            "records": [asdict(r) for r in self.records],
        }


def _usage_counts(usage: dict) -> tuple[int | None, int | None, int | None]:
    details = usage.get("prompt_tokens_details") or {}
    return usage.get("prompt_tokens"), details.get("cached_tokens"), usage.get("completion_tokens")


async def stream_chat(
    http: httpx.AsyncClient,
    messages: list[dict],
    record: RequestRecord,
    model: str | None,
    t0: float,
) -> None:
    """Send one streaming request and fill ``record`` in place (times, usage, answer)."""
    body = {
        "messages": messages,
        "max_tokens": record.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    start = time.perf_counter()
    record.sent_at = start - t0
    parts: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:500]
            raise ServerError(f"HTTP {response.status_code}: {text}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise ServerError(f"stream error: {event['error']}")
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if record.ttft_s is None:
                        record.ttft_s = time.perf_counter() - start
                    parts.append(content)
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
            if event.get("usage"):
                usage = _usage_counts(event["usage"])
                record.prompt_tokens, record.cached_tokens, record.completion_tokens = usage
    record.latency_s = time.perf_counter() - start
    record.answer = "".join(parts)
    n_out = record.completion_tokens
    if record.ttft_s is not None and n_out is not None and n_out > 1:
        # Tokens after the first, over the time after the first: the decode rate a user sees.
        record.tpot_s = (record.latency_s - record.ttft_s) / (n_out - 1)


async def _run_conversation(
    http: httpx.AsyncClient,
    conv: Conversation,
    system: str,
    model: str | None,
    t0: float,
    gate: asyncio.Semaphore,
    records: list[RequestRecord],
) -> None:
    async with gate:
        messages = [{"role": "system", "content": conv.system_prompt}]
        for turn, user_text in enumerate(conv.user_turns):
            if conv.think_times_s[turn] > 0:
                await asyncio.sleep(conv.think_times_s[turn])
            messages.append({"role": "user", "content": user_text})
            record = RequestRecord(
                system, conv.conversation_id, turn, 0.0, max_tokens=conv.answer_tokens[turn]
            )
            records.append(record)
            try:
                await stream_chat(http, list(messages), record, model, t0)
            except asyncio.CancelledError:
                record.cut_at_deadline = True
                raise
            except (ServerError, httpx.HTTPError, json.JSONDecodeError) as exc:
                # The history would be missing an answer: this conversation stops here.
                record.error = f"{type(exc).__name__}: {exc}"
                return
            messages.append({"role": "assistant", "content": record.answer})


async def warm_up(
    base_url: str, model: str | None = None, headers: dict[str, str] | None = None
) -> RequestRecord:
    """One short request before measuring, so lazy initialisation (first-batch setup,
    compilation) is not charged to the first turn. Its text shares no block-sized prefix
    with any workload prompt, so it cannot warm the prefix cache for the run."""
    messages = [
        {"role": "system", "content": "Warm-up request."},
        {"role": "user", "content": "Say hello."},
    ]
    record = RequestRecord("warm-up", "warm-up", 0, 0.0, max_tokens=4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers or {}, timeout=600.0) as http:
        await stream_chat(http, messages, record, model, time.perf_counter())
    return record


async def run_workload(
    base_url: str,
    workload: Workload,
    system: str,
    concurrency: int,
    model: str | None = None,
    headers: dict[str, str] | None = None,
    request_timeout_s: float = 600.0,
    transport: httpx.AsyncBaseTransport | None = None,
    deadline_s: float | None = None,
) -> RunResult:
    """Run every conversation of ``workload`` against ``base_url``, at most ``concurrency``
    conversations at a time (a user holds a slot through their think times).

    ``deadline_s`` bounds the run: conversations still going then are cancelled, their
    in-flight requests marked ``cut_at_deadline`` and the result ``truncated``.
    ``transport`` replaces the network (tests)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    result = RunResult(system)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=base_url,
        headers=headers or {},
        timeout=httpx.Timeout(request_timeout_s, connect=10.0),
        limits=limits,
        transport=transport,
    ) as http:
        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(
                _run_conversation(http, conv, system, model, t0, gate, result.records)
            )
            for conv in workload.conversations
        ]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        result.truncated = bool(pending)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            # A conversation's own bug must not pass silently as a short run.
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        result.wall_s = time.perf_counter() - t0
    result.records.sort(key=lambda r: r.sent_at)
    return result
