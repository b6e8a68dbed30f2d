"""Request bodies must say they are JSON.

Litestar parses any body as JSON whatever its Content-Type, so a form post or
text/plain would be accepted by accident; clients that mislabel a body get a
clear 415 instead, before anything reads it.
"""

from __future__ import annotations

from litestar.exceptions import HTTPException
from litestar.types import ASGIApp, Receive, Scope, Send

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# curl -d labels bodies as form data; the API docs' curl examples rely on it,
# and a form body that is not JSON still fails to parse (400).
_ACCEPTED = frozenset({"", "application/json", "application/x-www-form-urlencoded"})


class UnsupportedMediaTypeError(HTTPException):
    status_code = 415


def json_only_middleware(app: ASGIApp) -> ASGIApp:
    """Litestar middleware: 415 for a request body whose Content-Type is not JSON."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in _BODY_METHODS:
            content_type = ""
            for name, value in scope.get("headers", []):
                if name.lower() == b"content-type":
                    content_type = value.decode("latin-1").split(";")[0].strip().lower()
            if content_type not in _ACCEPTED:
                raise UnsupportedMediaTypeError(
                    f"request bodies must be application/json, got {content_type!r}"
                )
        await app(scope, receive, send)

    return wrapped
