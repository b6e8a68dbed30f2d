"""Logging for the service: a request id on every line, no conversation text by default.

    client --X-Request-ID?--> RequestIdMiddleware --sets--> current_request_id (contextvar)
                                      |                             |
                       echoes it in the response          RequestIdFilter stamps it on
                                                          every record as %(request_id)s

The contextvar follows the request's task and everything it awaits, so the
app's lines and uvicorn's access line carry the id. Lines outside any request
(start-up, the engine thread, which runs every request in one loop) carry "-".

Prompt and completion text never goes into a log line unless the operator opts
in with ``CHATSVC_LOG_TEXT=1`` (a debugging aid: logs are then as sensitive as
the conversations themselves). Code that wants to log text asks ``text_for_log``.
"""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar

from litestar.types import ASGIApp, Message, Receive, Scope, Send

NO_REQUEST = "-"
HEADER = "x-request-id"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [request_id=%(request_id)s] %(message)s"
# A client-supplied id is kept only when it is short and plain, so it cannot
# forge log lines (newlines) or bloat every line of the request.
_CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")

current_request_id: ContextVar[str] = ContextVar("chatsvc_request_id", default=NO_REQUEST)
_log_text = False


class RequestIdFilter(logging.Filter):
    """Puts the current request id on each record (``record.request_id``); drops nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id.get()
        return True


def configure_logging(level: str | int = "INFO", *, log_text: bool = False) -> None:
    """Send every logger's records (uvicorn's included) to stderr, each with its request id.

    Idempotent: a second call replaces the handler it installed before.
    """
    global _log_text
    _log_text = log_text
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_chatsvc", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler()
    handler._chatsvc = True  # type: ignore[attr-defined]
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    # uvicorn's loggers keep their level but hand records to the root handler.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True


def text_for_log(text: str) -> str:
    """``text`` itself when the operator opted in to logging text, else only its length."""
    return repr(text) if _log_text else f"<{len(text)} chars>"


def request_id_from(value: str | None) -> str:
    """The client's id when it is sane, else a fresh one."""
    if value is not None and _CLIENT_ID_RE.match(value):
        return value
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """ASGI middleware: assign or adopt a request id, expose it to logging, echo it back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        supplied = None
        for name, value in scope.get("headers", []):
            if name.lower() == HEADER.encode():
                supplied = value.decode("latin-1")
                break
        request_id = request_id_from(supplied)
        token = current_request_id.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                headers.append((HEADER.encode(), request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)
