"""413 for a body over the size limit, answered so that the client reads it.

Litestar refuses a body whose ``Content-Length`` is over the limit before
reading any of it, and uvicorn then closes the connection with the body still
arriving. Closing a socket with unread data makes the kernel send a reset, and
clients that send the whole body before reading the answer (urllib, httpx, the
openai SDK) see that reset instead of the 413. Reading the body to its end
first, up to ``MAX_DRAIN_BYTES`` and within the body deadline
(body_timeout.py), lets the answer arrive; ``Connection: close`` then ends the
connection. A body longer still is refused without the wait: reading it would
cost more than the client's clear answer is worth. A chunked body (no
``Content-Length``) is counted as it arrives and, once past the limit, drained
the same way.
"""

from __future__ import annotations

from litestar.exceptions import HTTPException
from litestar.types import ASGIApp, Message, Receive, Scope, Send

# What the server reads and throws away to answer one oversized request.
MAX_DRAIN_BYTES = 16 * 1024 * 1024


class BodyTooLargeError(HTTPException):
    status_code = 413


def body_limit_middleware(max_bytes: int):
    """A Litestar middleware factory refusing bodies longer than ``max_bytes``."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            length = _content_length(scope)
            if length is None:  # chunked: the limit is passed, if at all, while it arrives
                await app(scope, _counted(receive, max_bytes), send)
                return
            if length <= max_bytes:
                await app(scope, receive, send)
                return
            if length <= MAX_DRAIN_BYTES:
                await _drain(receive)
            raise BodyTooLargeError(
                f"the request body is {length} bytes; the limit is {max_bytes}",
                headers={"Connection": "close"},
            )

        return wrapped

    return middleware


def _counted(receive: Receive, max_bytes: int) -> Receive:
    """``receive`` for a body of unknown length: once past ``max_bytes`` the rest is
    read and dropped (as for a declared length), then the 413 names the limit."""
    received = 0

    async def counted() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
                if message.get("more_body", False):
                    await _drain(receive)
                raise BodyTooLargeError(
                    f"the request body is over the limit of {max_bytes} bytes",
                    headers={"Connection": "close"},
                )
        return message

    return counted


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's HTTP parser answers a malformed length
    return None


async def _drain(receive: Receive) -> None:
    """Read the body to its end (or the client's disconnect), keeping none of it."""
    received = 0
    while received <= MAX_DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        received += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
