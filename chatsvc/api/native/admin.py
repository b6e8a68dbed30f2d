"""Admin endpoints (admin key): cache statistics, Prometheus metrics, shared system prompts."""

from __future__ import annotations

from typing import Any

import anyio
from litestar import Controller, Response, delete, get, post
from litestar.params import FromPath, JSONBody

from chatsvc.api.native.schemas import CreateSharedPrompt, SystemPromptList, SystemPromptView
from chatsvc.api.native.system_prompts import prompt_view
from chatsvc.api.shared.auth import admin_guard
from chatsvc.api.shared.deps import ServicesDep
from chatsvc.api.shared.errors import (
    InvalidRequestError,
    NotFoundError,
    RateLimitError,
    ServiceUnavailableError,
    documented_errors,
)
from chatsvc.api.shared.rendering import check_text, system_prefix_tokens
from chatsvc.api.shared.store_access import UNKNOWN_PROMPT
from chatsvc.metrics import CONTENT_TYPE
from chatsvc.protocol import EngineClient, EngineStoppedError
from chatsvc.service import Services
from chatsvc.store.errors import InvalidInputError, LimitExceededError, MalformedIdError


class AdminController(Controller):
    path = "/"
    guards = [admin_guard]
    tags = ["admin"]

    @get(
        "/admin/cache",
        summary="Prefix-cache statistics",
        responses=documented_errors(400, 401, 403, 503),
    )
    async def cache(self, services: ServicesDep) -> dict[str, Any]:
        """The engine's cache view (block hit rates, reuse histogram, tier occupancy,
        evictions, swaps) under ``engine``, prompt-token usage aggregated by tenant
        and by system prompt under ``requests``, ``integrity``: "ok" when the
        cache's bookkeeping invariants hold, else the broken invariant, and this
        replica's id with its history turns and affinity misses under ``affinity``
        (definitions in chatsvc/affinity.py), and under ``storage`` the byte quotas
        with the bytes each of this replica's tenants stores."""
        # Both wait for the engine thread to finish its current step, so they see
        # the same consistent state between steps.
        try:
            engine = await anyio.to_thread.run_sync(services.engine.cache_stats)
            integrity = await anyio.to_thread.run_sync(_integrity, services.engine)
        except EngineStoppedError as exc:  # a dead engine has no cache to report
            raise ServiceUnavailableError(f"the engine is not running: {exc}") from None
        return {
            "engine": engine,
            "requests": services.usage.snapshot(),
            "integrity": integrity,
            "replica": services.metrics.replica,
            "affinity": services.affinity.snapshot(),
            "storage": await _storage(services),
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

    @post(
        "/admin/system-prompts",
        summary="Publish a shared system prompt",
        status_code=201,
        responses=documented_errors(400, 401, 403, 413, 429, 503),
    )
    async def publish_prompt(
        self, data: JSONBody[CreateSharedPrompt], services: ServicesDep
    ) -> SystemPromptView:
        """Every tenant can read the prompt and start sessions on it, and the KV blocks
        of its tokens are shared across tenants: put nothing secret in it. 429 at
        ``CHATSVC_MAX_SHARED_SYSTEM_PROMPTS``."""
        text = check_text(data.text, services, "system prompt")
        token_ids = await system_prefix_tokens(services, text)
        limit = services.settings.limits.max_shared_system_prompts
        try:
            prompt = await services.store.prompts.create_shared(
                data.name, text, token_ids, limit=limit
            )
        except LimitExceededError:
            raise RateLimitError(
                f"there are already {limit} shared system prompts; withdraw some first"
            ) from None
        except InvalidInputError as exc:
            raise InvalidRequestError(str(exc)) from None
        return prompt_view(prompt)

    @get(
        "/admin/system-prompts",
        summary="Every shared system prompt",
        responses=documented_errors(400, 401, 403, 503),
    )
    async def shared_prompts(self, services: ServicesDep) -> SystemPromptList:
        prompts = await services.store.prompts.all_shared()
        return SystemPromptList(system_prompts=[prompt_view(p) for p in prompts])

    @delete(
        "/admin/system-prompts/{prompt_id:str}",
        summary="Withdraw a shared system prompt",
        status_code=204,
        responses=documented_errors(400, 401, 403, 404, 503),
    )
    async def withdraw_prompt(self, prompt_id: FromPath[str], services: ServicesDep) -> None:
        """Sessions started on it keep working (they hold their own copy); later turns
        of theirs hash its blocks privately. A tenant's private prompt answers 404."""
        try:
            deleted = await services.store.prompts.delete_shared(prompt_id)
        except MalformedIdError:
            deleted = False
        if not deleted:
            raise NotFoundError(UNKNOWN_PROMPT)


async def _storage(services: Services) -> dict[str, Any]:
    limits = services.settings.limits
    directory = services.tenants
    tenants = {t.id: t for _, t in directory.entries}
    if directory.local is not None:
        tenants[directory.local.id] = directory.local
    used = {t.name: await services.store.sessions.bytes_used(t.id) for t in tenants.values()}
    return {
        "max_session_bytes": limits.max_session_bytes,
        "max_tenant_bytes": limits.max_tenant_bytes,
        "bytes_used_by_tenant": used,
    }


def _integrity(engine: EngineClient) -> str:
    try:
        engine.check_integrity()
    except AssertionError as exc:  # CacheIntegrityError is one; a report, not a 500
        return f"broken: {exc}"
    return "ok"
