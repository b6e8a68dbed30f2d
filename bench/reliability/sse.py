"""A minimal client for chatsvc's streaming turn (``POST /sessions/{id}/messages``, SSE).

The client side of the acknowledgement rule: a turn is acknowledged when, and
only when, the stream delivers a ``done`` event (sent after ``commit_turn``
committed). Everything else (an ``error`` event, a cut connection, an HTTP
error) is not an acknowledgement.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from chatsvc.chat_client import SseDecoder


@dataclass
class StreamOutcome:
    """What one streaming turn produced, as the client saw it."""

    status: int = 0
    deltas: list[str] = field(default_factory=list)
    done: dict | None = None  # the done event's body: the turn is acknowledged
    error: dict | None = None  # an error event's or error response's body
    transport_error: str | None = None  # connection refused / cut mid-stream
    ttft_s: float | None = None  # first delta, measured by the client
    latency_s: float | None = None

    @property
    def acknowledged(self) -> bool:
        return self.done is not None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


async def _aparse(response: httpx.Response):
    """(event, data) pairs of an SSE response body, as they arrive."""
    decoder = SseDecoder()
    async for line in response.aiter_lines():
        if (event := decoder.feed(line)) is not None:
            yield event
    if (event := decoder.end()) is not None:
        yield event


async def stream_turn(
    http: httpx.AsyncClient, session_id: str, body: dict, on_delta=None
) -> StreamOutcome:
    """Post one streaming turn and read it to its end; never raises for server failures.

    ``on_delta(outcome)`` is called after each delta (the crash loop uses it to
    know which streams are mid-generation).
    """
    outcome = StreamOutcome()
    start = time.perf_counter()
    try:
        async with http.stream(
            "POST", f"/sessions/{session_id}/messages", json={**body, "stream": True}
        ) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                outcome.error = _json_or_text(response.text)
                return outcome
            async for event, data in _aparse(response):
                if event == "delta":
                    if outcome.ttft_s is None:
                        outcome.ttft_s = time.perf_counter() - start
                    outcome.deltas.append(json.loads(data)["text"])
                    if on_delta is not None:
                        on_delta(outcome)
                elif event == "done":
                    outcome.done = json.loads(data)
                elif event == "error":
                    outcome.error = json.loads(data)
    except httpx.HTTPError as exc:
        outcome.transport_error = f"{type(exc).__name__}: {exc}"
    outcome.latency_s = time.perf_counter() - start
    return outcome


def _json_or_text(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {"error": {"type": "non_json", "message": text[:500]}}
    return value if isinstance(value, dict) else {"error": {"type": "non_json", "message": text}}
