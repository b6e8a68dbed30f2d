"""Admin endpoints (admin key): cache statistics and Prometheus metrics."""

from __future__ import annotations

from typing import Any

import anyio
from litestar import Controller, Response, get

from chatsvc.api.auth import admin_guard
from chatsvc.api.deps import ServicesDep
from chatsvc.metrics import CONTENT_TYPE


class AdminController(Controller):
    path = "/"
    guards = [admin_guard]
    tags = ["admin"]

    @get("/admin/cache", summary="Prefix-cache statistics")
    async def cache(self, services: ServicesDep) -> dict[str, Any]:
        """The engine's cache view (block hit rates, reuse histogram, tier occupancy,
        evictions, swaps) under ``engine``, and prompt-token usage aggregated by
        tenant and by system prompt under ``requests``."""
        # cache_stats waits for the engine thread to finish its current step.
        engine = await anyio.to_thread.run_sync(services.engine.cache_stats)
        return {"engine": engine, "requests": services.usage.snapshot()}

    @get("/metrics", summary="Prometheus metrics", media_type=CONTENT_TYPE)
    async def metrics(self, services: ServicesDep) -> Response[bytes]:
        body = await anyio.to_thread.run_sync(services.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)
