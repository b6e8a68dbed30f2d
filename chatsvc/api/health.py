"""Liveness and readiness probes (no auth: load balancers and orchestrators call them)."""

from __future__ import annotations

from litestar import Response, get
from litestar.openapi.datastructures import ResponseSpec

from chatsvc.api.deps import ServicesDep
from chatsvc.api.schemas import Health


@get("/healthz", summary="The process is up", tags=["health"])
async def healthz() -> Health:
    return Health(status="ok")


@get(
    "/readyz",
    summary="Redis answers PING and the engine is started",
    tags=["health"],
    responses={503: ResponseSpec(Health, description="Not ready", generate_examples=False)},
)
async def readyz(services: ServicesDep) -> Response[Health]:
    """200 when both are ready, else 503 with the failing check named."""
    checks = {"engine": "ok" if services.engine_started else "not started"}
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
