"""Liveness and readiness probes (no auth: load balancers and orchestrators call them).

Each answers HEAD as well as GET (the same status, no body): uptime monitors and some
load balancers probe with HEAD.
"""

from __future__ import annotations

import msgspec
from litestar import Response, route
from litestar.openapi.datastructures import ResponseSpec

from chatsvc.api.shared.deps import ServicesDep


class Health(msgspec.Struct, kw_only=True):
    status: str
    checks: dict[str, str] = msgspec.field(default_factory=dict)


_PROBE = ["GET", "HEAD"]


@route("/healthz", http_method=_PROBE, summary="The process is up", tags=["health"])
async def healthz() -> Health:
    return Health(status="ok")


# "/health" is the readiness probe's name on vLLM, SGLang, TGI and llama.cpp's server
# (each answers 200 there only once its model serves), so their probes work unchanged.
@route(
    ["/readyz", "/health"],
    http_method=_PROBE,
    summary="Redis answers PING and the engine is loaded, warmed up and serving",
    tags=["health"],
    responses={503: ResponseSpec(Health, description="Not ready", generate_examples=False)},
)
async def readyz(services: ServicesDep) -> Response[Health]:
    """200 when both are ready, else 503 with the failing check named (during start-up
    the engine's check names the phase: "loading the model", "warming up")."""
    checks = {"engine": _engine_check(services)}
    try:
        await services.store.redis.ping()
        checks["store"] = "ok"
    except Exception as exc:  # any failure means "not ready"; the reason goes in the body
        checks["store"] = f"unavailable: {type(exc).__name__}"
    ready = all(value == "ok" for value in checks.values())
    return Response(
        Health(status="ok" if ready else "unavailable", checks=checks),
        status_code=200 if ready else 503,
    )


def _engine_check(services: ServicesDep) -> str:
    phase = services.not_serving  # "loading the model", then "warming up"
    if phase is not None:
        return phase
    failure = services.engine.failure
    if failure is not None:
        # The type only: this probe answers without auth.
        return f"died: {type(failure).__name__}"
    return "ok"
