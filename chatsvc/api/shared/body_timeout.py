"""A deadline on reading a request body, against slow-loris clients.

uvicorn bounds idle keep-alive connections but not a request whose body
trickles in (or stops): the handler would wait on ``receive()`` forever, one
task and one socket per such client. This middleware gives the *whole* body
``timeout_s`` from the moment the app first asks for it; a deadline per chunk
would never fire for a client that sends one byte just inside it, again and
again. A client that misses the deadline gets 408 and the connection closes.
Once the body is complete the deadline is off, so a long SSE stream (which
keeps awaiting ``receive()`` only to notice a disconnect) is not cut.
"""

from __future__ import annotations

import anyio
from litestar.exceptions import HTTPException
from litestar.types import ASGIApp, Message, Receive, Scope, Send


class BodyReadTimeoutError(HTTPException):
    status_code = 408
    detail = "the request body did not arrive in time"


def body_timeout_middleware(timeout_s: float):
    """A Litestar middleware factory bound to ``timeout_s`` seconds for the whole body."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            body_done = False
            deadline: float | None = None

            async def receive_with_deadline() -> Message:
                nonlocal body_done, deadline
                if body_done:
                    return await receive()
                if deadline is None:
                    deadline = anyio.current_time() + timeout_s
                try:
                    with anyio.fail_after(max(deadline - anyio.current_time(), 0.0)):
                        message = await receive()
                except TimeoutError:
                    raise BodyReadTimeoutError(
                        f"the request body did not arrive within {timeout_s:g} s",
                        # The unread rest of the body may still be arriving.
                        headers={"Connection": "close"},
                    ) from None
                if message["type"] != "http.request" or not message.get("more_body", False):
                    body_done = True
                return message

            await app(scope, receive_with_deadline, send)

        return wrapped

    return middleware
