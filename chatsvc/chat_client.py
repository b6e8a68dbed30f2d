"""A terminal chat client: one session, answers streamed as they are generated.

    python -m chatsvc chat [--session ID] [--url http://127.0.0.1:8000] [--system TEXT]

Lines typed are user messages; ``/quit`` (or end of input) leaves, ``/history``
prints the session so far. The API key comes from ``--api-key`` or
``$CHATSVC_API_KEY`` (not needed against a local service without keys).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import TextIO

import httpx


class ChatClientError(RuntimeError):
    """The service answered with an error body."""


def _raise_for_error(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        error = response.json()["error"]
        message = f"{error['type']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    raise ChatClientError(f"HTTP {response.status_code}: {message}")


class SseDecoder:
    """Incremental text/event-stream decoding: feed lines, get each event as it completes."""

    def __init__(self) -> None:
        self.event, self.data = "message", []

    def feed(self, line: str) -> tuple[str, str] | None:
        """The (event, data) pair this line completes, if any."""
        line = line.rstrip("\r")
        if not line:
            done = (self.event, "\n".join(self.data)) if self.data else None
            self.event, self.data = "message", []
            return done
        if line.startswith("event:"):
            self.event = line[6:].strip()
        elif line.startswith("data:"):
            self.data.append(line[5:].removeprefix(" "))
        return None

    def end(self) -> tuple[str, str] | None:
        """The last event, when the stream ended without a blank line after it."""
        return self.feed("")


def iter_sse(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event, data) pairs from the lines of a text/event-stream body."""
    decoder = SseDecoder()
    for line in lines:
        if (event := decoder.feed(line)) is not None:
            yield event
    if (event := decoder.end()) is not None:
        yield event


class ChatClient:
    """Talks to one chatsvc over HTTP; each method is one request."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 300.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def create_session(self, system_prompt: str | None = None) -> str:
        body = {} if system_prompt is None else {"system_prompt": system_prompt}
        response = self.http.post("/sessions", json=body)
        _raise_for_error(response)
        return response.json()["id"]

    def history(self, session_id: str) -> list[dict]:
        response = self.http.get(f"/sessions/{session_id}/messages")
        _raise_for_error(response)
        return response.json()["messages"]

    def send(self, session_id: str, text: str, **options) -> Iterator[str | dict]:
        """Yield pieces of the answer, then the final TurnResult dict."""
        body = {"content": text, "stream": True, **options}
        with self.http.stream("POST", f"/sessions/{session_id}/messages", json=body) as response:
            if not response.is_success:
                response.read()
                _raise_for_error(response)
            for event, data in iter_sse(response.iter_lines()):
                payload = json.loads(data)
                if event == "delta":
                    yield payload["text"]
                elif event == "done":
                    yield payload
                elif event == "error":
                    error = payload["error"]
                    raise ChatClientError(f"{error['type']}: {error['message']}")


def run(
    client: ChatClient,
    session_id: str | None,
    system_prompt: str | None,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
    **options,
) -> int:
    """The interactive loop; returns the process exit status."""
    if session_id is None:
        session_id = client.create_session(system_prompt)
    print(f"session {session_id}  (/history, /quit)", file=stdout)
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/quit":
            return 0
        text = line.rstrip("\n")
        if text.strip() == "/history":
            for message in client.history(session_id):
                print(f"[{message['role']}] {message['content']}", file=stdout)
            continue
        if not text.strip():
            continue
        try:
            for item in client.send(session_id, text, **options):
                if isinstance(item, str):
                    stdout.write(item)
                    stdout.flush()
                else:
                    usage = item["usage"]
                    print(
                        f"\n  [{usage['completion_tokens']} tokens, "
                        f"{usage['cached_tokens']}/{usage['prompt_tokens']} prompt tokens cached, "
                        f"ttft {item['timings']['ttft_s'] * 1000:.0f} ms]",
                        file=stdout,
                    )
        except ChatClientError as exc:
            print(f"\n  error: {exc}", file=stdout)
