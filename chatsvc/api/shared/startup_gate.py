"""503 for every route but the probes and /metrics while the engine comes up.

The app serves from its first second (service.py): ``/healthz`` is live and
``/readyz`` names the start-up phase, so an orchestrator sees a process that
is starting rather than one that hangs, and a load balancer sends nothing until
``/readyz`` is 200. A client that calls anyway is told to come back
(``Retry-After``) rather than being served cold: its turn would pay the model
load, and a delete could not forget the session's KV in an engine that is not
there yet.
"""

from __future__ import annotations

from collections.abc import Callable

from litestar.types import ASGIApp, Receive, Scope, Send

from chatsvc.api.shared.errors import ServiceUnavailableError

# What an orchestrator and an operator read during start-up.
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health", "/metrics"})
# Seconds a refused client waits: warm-up takes seconds, not minutes.
RETRY_AFTER_S = 2


def startup_gate_middleware(starting: Callable[[Scope], str | None]):
    """A middleware factory: ``starting(scope)`` is the start-up phase the app is in
    (None: serving); meanwhile requests outside ``OPEN_PATHS`` get a 503."""

    def middleware(app: ASGIApp) -> ASGIApp:
        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
                phase = starting(scope)
                if phase is not None:
                    raise ServiceUnavailableError(
                        f"the service is starting ({phase}); retry in a few seconds",
                        error_type="service_starting",
                        headers={"Retry-After": str(RETRY_AFTER_S)},
                    )
            await app(scope, receive, send)

        return wrapped

    return middleware
