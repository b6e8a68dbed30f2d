"""Admin endpoints (admin key): cache statistics and Prometheus metrics."""

from __future__ import annotations

from typing import Any

import anyio
from litestar import Controller, Response, get

from chatsvc.api.auth import admin_guard
from chatsvc.api.deps import ServicesDep
from chatsvc.api.errors import documented_errors
from chatsvc.metrics import CONTENT_TYPE


class AdminController(Controller):
    path = "/"
    guards = [admin_guard]
    tags = ["admin"]

    @get(
        "/admin/cache",
        summary="Prefix-cache statistics",
        responses=documented_errors(400, 401, 403),
    )
    async def cache(self, services: ServicesDep) -> dict[str, Any]:
        """The engine's cache view (block hit rates, reuse histogram, tier occupancy,
        evictions, swaps) under ``engine``, prompt-token usage aggregated by tenant
        and by system prompt under ``requests``, ``integrity``: "ok" when the
        cache's bookkeeping invariants hold, else the broken invariant, and this
        replica's id with its history turns and affinity misses under ``affinity``
        (definitions in chatsvc/affinity.py)."""
        # Both wait for the engine thread to finish its current step, so they see
        # the same consistent state between steps.
        engine = await anyio.to_thread.run_sync(services.engine.cache_stats)
        integrity = await anyio.to_thread.run_sync(_integrity, services.engine)
        return {
            "engine": engine,
            "requests": services.usage.snapshot(),
            "integrity": integrity,
            "replica": services.metrics.replica,
            "affinity": services.affinity.snapshot(),
        }

    @get(
        "/metrics",
        summary="Prometheus metrics",
        media_type=CONTENT_TYPE,
        responses=documented_errors(400, 401, 403),
    )
    async def metrics(self, services: ServicesDep) -> Response[bytes]:
        body = await anyio.to_thread.run_sync(services.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)


def _integrity(engine: Any) -> str:
    try:
        engine.check_integrity()
    except AssertionError as exc:  # CacheIntegrityError is one; a report, not a 500
        return f"broken: {exc}"
    return "ok"
