"""413 for a body over the size limit, before the handler reads any of it.

A body whose ``Content-Length`` is over the limit is refused unread; a chunked
body (no ``Content-Length``) is counted as it arrives and refused once past it.
Either way the answer carries ``Connection: close`` and the rest of the body is
still arriving: the server's lingering close (``chatsvc.api.http_server``) reads
and drops it, so that clients which send the whole body before reading (urllib,
httpx, the openai SDK) read the 413 instead of a reset.
"""

from __future__ import annotations

from litestar.exceptions import HTTPException
from litestar.types import ASGIApp, Message, Receive, Scope, Send


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
            if length > max_bytes:
                raise BodyTooLargeError(
                    f"the request body is {length} bytes; the limit is {max_bytes}",
                    headers={"Connection": "close"},
                )
            await app(scope, receive, send)

        return wrapped

    return middleware


def _counted(receive: Receive, max_bytes: int) -> Receive:
    """``receive`` for a body of unknown length, refusing it once past ``max_bytes``."""
    received = 0

    async def counted() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
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
