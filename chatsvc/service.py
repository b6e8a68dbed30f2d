"""Wiring: settings -> store + engine -> app. The app's lifespan owns both clients.

Start order: Redis (embedded when no URL), the store (which applies pending
migrations), tenants from the settings; then the app serves while the engine
comes up in the background (loads the model, then warms up: engine/warmup.py),
so ``/healthz`` answers at once, ``/readyz`` says which phase it is in, and a
SIGTERM during the load stops the service without waiting for it. Every other
route answers 503 until the engine serves (api/shared/startup_gate.py): a
request during start-up would pay the cold start itself, or find no engine to
forget a deleted session's KV. Shutdown runs in reverse, and a failure at any
start step undoes the earlier ones; an engine that fails to start ends the
service (``on_start_failure``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
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
    # True once the engine serves (loaded and warmed), False again at shutdown.
    engine_started: bool = False
    # While the engine comes up: what it is doing ("loading the model", "warming up");
    # None once it serves or failed to start.
    starting: str | None = "starting"
    start_failure: BaseException | None = None
    # Called once, on the event loop, when the engine fails to start.
    on_start_failure: list[Callable[[BaseException], None]] = field(default_factory=list)
    # Unix time the service came up (the ``created`` of /v1/models).
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def not_serving(self) -> str | None:
        """Why the engine does not serve (None once it does): the start-up phase it is
        in, its failure to start, or "stopped" once shut down."""
        if self.engine_started:
            return None
        if self.start_failure is not None:
            return f"failed to start: {type(self.start_failure).__name__}"
        return self.starting or "stopped"

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
        # In a thread: importing the engine imports torch (seconds), and /healthz waits.
        engine = await anyio.to_thread.run_sync(build_engine, settings)
        services = Services(settings=settings, store=store, engine=engine, tenants=tenants)
        # Runs after the start task below is cancelled or done, before the store closes.
        stack.push_async_callback(engine.stop)
        bring_up = asyncio.create_task(start_engine(services), name="chatsvc-engine-start")
        stack.push_async_callback(_cancel, bring_up)
        # A dead or unstarted engine answers no command: /metrics then reports no tier
        # gauges rather than waiting for it (/readyz says why).
        services.metrics.sample_tiers_with(
            lambda: tier_usage(engine.cache_stats()) if _serving(services) else {}
        )
        services.metrics.sample_tier_traffic_with(
            lambda: engine.cache_stats() if _serving(services) else {}
        )
        try:
            yield services
        finally:
            services.engine_started = False


async def start_engine(services: Services) -> None:
    """Load the model and warm the engine up; then it serves (``engine_started``).

    A failure is logged, kept in ``start_failure`` and handed to ``on_start_failure``
    (``serve`` exits): a replica that cannot serve must not stay up unready forever.
    """
    engine = services.engine
    settings = services.settings
    try:
        services.starting = "loading the model"
        began = time.perf_counter()
        await engine.start()
        loaded = time.perf_counter() - began
        info = engine.info
        # The library's hash tells an operator which compiled kernels run inside the service.
        digest = info.kernel_library_sha256
        log.info(
            "engine loaded in %.1f s: %s, %s, weights %s, kernels %s%s, "
            "%d KV blocks of %d tokens in %s",
            loaded,
            info.model_name,
            info.dtype,
            info.weight_layout,
            info.kernel_backend,
            f" (library sha256 {digest})" if digest else "",
            info.num_gpu_blocks,
            info.block_size,
            info.kv_dtype,
        )
        services.starting = "warming up"
        began = time.perf_counter()
        shapes = await engine.warm_up()
        log.info(
            "engine warmed up in %.1f s (budget %.1f s): %s",
            time.perf_counter() - began,
            settings.engine.warm_up_s,
            ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in shapes) or "nothing",
        )
    except Exception as error:  # noqa: BLE001 - the service's end, reported below
        log.critical("the engine failed to start; the service stops", exc_info=error)
        services.start_failure = error
        for callback in services.on_start_failure:
            callback(error)
        return
    finally:
        services.starting = None
    services.engine_started = True


def _serving(services: Services) -> bool:
    return services.engine_started and services.engine.is_running


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


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
