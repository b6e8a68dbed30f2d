"""Requests must name this server in their ``Host`` header (DNS-rebinding guard).

A web page can point its own DNS name at 127.0.0.1 (DNS rebinding) and then
read a loopback server's answers as same-origin; the browser still sends the
page's own name as ``Host``. So a local-mode server (no API keys, nothing else
guarding it) serves only the names on its allow-list: loopback names by default,
with any port (``Settings.host_allow_list``).

Litestar's ``AllowedHostsConfig`` is not used: it matches the whole header,
port included, case-sensitively, and answers in its own error shape.
"""

from __future__ import annotations

from litestar.types import ASGIApp, Receive, Scope, Send

from chatsvc.api.shared.errors import InvalidHostError
from chatsvc.config import normalize_host_name


def host_name(header: str) -> str | None:
    """The normalized name of a ``Host`` header value without its port; None if malformed."""
    value = header.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[: end + 1], value[end + 1 :]
    else:
        name, colon, port = value.partition(":")
        rest = colon + port
    if rest:
        port = rest[1:]
        # RFC 3986 allows an empty port ("localhost:"); isdigit() alone takes "²" too.
        if rest[0] != ":" or not (port == "" or (port.isascii() and port.isdigit())):
            return None
    return normalize_host_name(name) if name else None


def allowed_hosts_middleware(allowed: frozenset[str] | None):
    """A Litestar middleware factory: 400 ``invalid_host`` unless ``Host`` names one of
    ``allowed`` (None: every request passes). A request without ``Host`` is refused too."""

    def middleware(app: ASGIApp) -> ASGIApp:
        if allowed is None:
            return app

        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] in ("http", "websocket"):
                headers = [v for k, v in scope.get("headers", []) if k.lower() == b"host"]
                # Two Host headers are malformed (RFC 9112); a proxy may pick the other.
                name = host_name(headers[0].decode("latin-1")) if len(headers) == 1 else None
                if name not in allowed:
                    raise InvalidHostError(
                        "this server does not answer to the host named in the Host header; "
                        "the names it serves are set by CHATSVC_ALLOWED_HOSTS"
                    )
            await app(scope, receive, send)

        return wrapped

    return middleware
