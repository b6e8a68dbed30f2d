"""Request bodies must say they are JSON.

Litestar parses any body as JSON whatever its Content-Type. Accepting that
would let a web page drive the API: a browser sends a cross-site POST without
asking the server first (no CORS preflight) only when its Content-Type is one
of the "simple" ones an HTML form can produce (form-urlencoded, multipart,
text/plain) or when it has none (a fetch of an untyped Blob). So every
POST/PUT/PATCH must carry ``Content-Type: application/json``, which a page can
set only after a preflight this server never grants; anything else is a 415
before anything reads the body. The rule holds with and without API keys: a
proxy in front that adds credentials from a browser's cookies would otherwise
reopen the same hole.
"""

from __future__ import annotations

from litestar.exceptions import HTTPException
from litestar.types import ASGIApp, Receive, Scope, Send

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_ACCEPTED = "application/json"


class UnsupportedMediaTypeError(HTTPException):
    status_code = 415


def media_type(scope: Scope) -> str | None:
    """The request's Content-Type without parameters, lower case; None when absent."""
    found = None
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-type":
            found = value.decode("latin-1").split(";")[0].strip().lower()
    return found


def json_only_middleware(app: ASGIApp) -> ASGIApp:
    """Litestar middleware: 415 for a POST/PUT/PATCH that is not labelled application/json."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in _BODY_METHODS:
            found = media_type(scope)
            if found != _ACCEPTED:
                said = "no Content-Type" if found is None else f"{found!r}"
                raise UnsupportedMediaTypeError(
                    f"request bodies must be sent as Content-Type: application/json, got {said}"
                )
        await app(scope, receive, send)

    return wrapped
