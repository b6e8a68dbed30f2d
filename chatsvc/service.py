"""Wiring: settings -> store + engine -> app. The app's lifespan owns both clients.

Start order: Redis (embedded when no URL), the store (which applies pending
migrations), tenants from the settings, then the engine (loads the model).
Shutdown runs in reverse, and a failure at any start step undoes the earlier ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio

from chatsvc.affinity import AffinityTracker
from chatsvc.config import LOCAL_TENANT, Settings
from chatsvc.metrics import Metrics, UsageStats, replica_label
from chatsvc.protocol import EngineClient
from chatsvc.store import Store
from chatsvc.tenants import TenantDirectory

log = logging.getLogger(__name__)


class StreamLimiter:
    """Caps the generations one tenant runs at once (a single event loop: no lock needed)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._active: dict[str, int] = {}

    def try_acquire(self, tenant_id: str) -> bool:
        held = self.active(tenant_id)
        if held >= self.limit:
            return False
        self._active[tenant_id] = held + 1
        return True

    def release(self, tenant_id: str) -> None:
        left = self._active.get(tenant_id, 0) - 1
        if left > 0:
            self._active[tenant_id] = left
        else:
            self._active.pop(tenant_id, None)

    def active(self, tenant_id: str) -> int:
        """Generations the tenant runs now."""
        return self._active.get(tenant_id, 0)


@dataclass
class Services:
    """What handlers receive by dependency injection."""

    settings: Settings
    store: Store
    engine: EngineClient
    metrics: Metrics = field(default_factory=Metrics)
    usage: UsageStats = field(default_factory=UsageStats)
    affinity: AffinityTracker = field(default_factory=AffinityTracker)
    tenants: TenantDirectory = field(default_factory=TenantDirectory)
    streams: StreamLimiter | None = None
    engine_started: bool = False
    # Unix time the service came up (the ``created`` of /v1/models).
    started: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if self.streams is None:
            self.streams = StreamLimiter(self.settings.limits.max_streams_per_tenant)
        if self.metrics.replica is None:
            self.metrics.replica = replica_label(self.settings)


async def bootstrap_tenants(store: Store, settings: Settings) -> TenantDirectory:
    """The tenants this replica admits: each configured key's tenant, found by its name.

    A tenant is created the first time its name is configured and kept for ever
    after, so a rotated key reaches the same tenant. Safe to run on replicas
    starting together (``store.tenants.ensure`` is idempotent and race-safe).
    Without keys, every request acts as the one local tenant, named "local".
    """
    tenants = []
    for name, key in settings.api_keys:
        tenants.append((key, await store.tenants.ensure(name)))
    if settings.auth_enabled:
        return TenantDirectory.of_keys(tenants)
    return TenantDirectory(local=await store.tenants.ensure(LOCAL_TENANT))


def build_engine(settings: Settings) -> EngineClient:
    """The engine for ``settings.engine`` (loaded by ``start()``, not here).

    The only place the service names the implementation: importing it loads torch.
    """
    from chatsvc.engine.async_engine import AsyncEngine

    return AsyncEngine(settings.engine)


@asynccontextmanager
async def running_services(settings: Settings) -> AsyncIterator[Services]:
    """Start Redis (if embedded), the store and the engine; stop them all on exit."""
    async with AsyncExitStack() as stack:
        url = settings.redis_url
        if url is None:
            from chatsvc.store.embedded import EmbeddedRedis

            embedded = EmbeddedRedis(settings.redis_dir())
            # start/stop block for a few ms up to the server's readiness wait.
            await anyio.to_thread.run_sync(embedded.start)
            stack.push_async_callback(anyio.to_thread.run_sync, embedded.stop)
            url = embedded.url
            log.info("embedded Redis at %s (data in %s)", url, settings.redis_dir())
        store = await Store.connect(
            url,
            prefix=settings.key_prefix,
            session_ttl_s=settings.session_ttl_s,
            lock_ttl_s=settings.turn_lock_ttl_s,
            max_session_bytes=settings.limits.max_session_bytes,
            max_tenant_bytes=settings.limits.max_tenant_bytes,
        )
        stack.push_async_callback(store.close)
        tenants = await bootstrap_tenants(store, settings)
        engine = build_engine(settings)
        services = Services(settings=settings, store=store, engine=engine, tenants=tenants)
        await engine.start()
        info = engine.info
        # The library's hash tells an operator which compiled kernels run inside the service.
        digest = info.kernel_library_sha256
        log.info(
            "engine ready: %s, %s, kernels %s%s, %d KV blocks of %d tokens",
            info.model_name,
            info.dtype,
            info.kernel_backend,
            f" (library sha256 {digest})" if digest else "",
            info.num_gpu_blocks,
            info.block_size,
        )
        services.engine_started = True
        stack.push_async_callback(engine.stop)
        # A dead engine answers no command: /metrics then reports no tier gauges
        # rather than failing the scrape (/readyz says why).
        services.metrics.sample_tiers_with(
            lambda: tier_usage(engine.cache_stats()) if engine.is_running else {}
        )
        services.metrics.sample_tier_traffic_with(
            lambda: engine.cache_stats() if engine.is_running else {}
        )
        yield services
        services.engine_started = False


def tier_usage(stats: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(occupied, total) blocks per tier out of ``engine.cache_stats()``.

    A device block is occupied when referenced or holding cached data (not free).
    """
    usage = {}
    for tier in ("device", "host", "disk"):
        info = stats.get(tier)
        if isinstance(info, dict) and "total" in info:
            total = int(info["total"])
            usage[tier] = (total - int(info.get("free", total)), total)
    return usage
