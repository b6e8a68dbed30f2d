"""One streamed turn through each API, measured from the client: TTFT, bytes sent, usage.

- ``chat``: ``/v1/chat/completions`` with the whole history resent every turn (what a
  stateless client does; the server's prefix cache finds the repeated part).
- ``responses``: ``/v1/responses`` with ``previous_response_id``: only the new user
  message travels; the server continues the stored turn.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

JSON = {"Content-Type": "application/json"}


class TurnFailed(RuntimeError):
    """The server answered an HTTP error or ended the stream with an error event."""


@dataclass
class TurnRecord:
    """One request as the client saw it (seconds; bytes of the request body)."""

    api: str
    conversation: str
    turn: int
    bytes_sent: int
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    answer: str = ""
    response_id: str | None = None


async def _events(response: httpx.Response):
    """(event name, data) of an SSE stream; the name is None where the server sent none."""
    name = None
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            yield name, line[5:].strip()
            name = None


async def chat_turn(
    http: httpx.AsyncClient, model: str, messages: list[dict], record: TurnRecord, max_tokens: int
) -> None:
    """A streamed chat completion over the whole ``messages`` history; fills ``record``."""
    body = json.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    record.bytes_sent = len(body)
    start = time.perf_counter()
    parts: list[str] = []
    async with http.stream("POST", "/v1/chat/completions", content=body, headers=JSON) as reply:
        if reply.status_code != 200:
            raise TurnFailed(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for _, data in _events(reply):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise TurnFailed(str(chunk["error"]))
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    record.ttft_s = record.ttft_s or time.perf_counter() - start
                    parts.append(text)
            if chunk.get("usage"):
                usage = chunk["usage"]
                record.prompt_tokens = usage["prompt_tokens"]
                record.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                record.completion_tokens = usage["completion_tokens"]
    record.latency_s = time.perf_counter() - start
    record.answer = "".join(parts)


async def responses_turn(
    http: httpx.AsyncClient,
    model: str,
    request: dict,
    record: TurnRecord,
    max_tokens: int,
) -> None:
    """A streamed response (``request``: input, and instructions or previous_response_id)."""
    body = json.dumps(
        {"model": model, "max_output_tokens": max_tokens, "temperature": 0, "stream": True}
        | request
    ).encode()
    record.bytes_sent = len(body)
    start = time.perf_counter()
    parts: list[str] = []
    async with http.stream("POST", "/v1/responses", content=body, headers=JSON) as reply:
        if reply.status_code != 200:
            raise TurnFailed(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for name, data in _events(reply):
            event = json.loads(data)
            if name == "response.output_text.delta":
                record.ttft_s = record.ttft_s or time.perf_counter() - start
                parts.append(event["delta"])
            elif name in ("response.completed", "response.incomplete"):
                response = event["response"]
                usage = response["usage"]
                record.response_id = response["id"]
                record.prompt_tokens = usage["input_tokens"]
                record.cached_tokens = usage["input_tokens_details"]["cached_tokens"]
                record.completion_tokens = usage["output_tokens"]
            elif name in ("error", "response.failed"):
                raise TurnFailed(data[:300])
    record.latency_s = time.perf_counter() - start
    record.answer = "".join(parts)
