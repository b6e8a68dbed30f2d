"""The Litestar application: controllers, dependencies, error mapping, lifespan.

It composes the two public surfaces, ``native/`` (sessions, messages, branches,
system prompts, admin, health) and ``openai/`` (the OpenAI-compatible ``/v1``),
over what both use, ``shared/`` (guards, errors, auth, the engine calls) and
``turn/`` (one turn of a session).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.datastructures import Headers, State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.types import Scope

import chatsvc
from chatsvc.api.native.admin import AdminController
from chatsvc.api.native.branches import BranchController
from chatsvc.api.native.health import healthz, readyz
from chatsvc.api.native.messages import MessageController
from chatsvc.api.native.sessions import SessionController
from chatsvc.api.native.system_prompts import SystemPromptController
from chatsvc.api.openai.caller_ids import PROMPT_CACHE_KEY_HEADER
from chatsvc.api.openai.chat_completions import ChatCompletionsController
from chatsvc.api.openai.completions import CompletionsController
from chatsvc.api.openai.conversations import ConversationController
from chatsvc.api.openai.models import ModelsController
from chatsvc.api.openai.responses import ResponsesController
from chatsvc.api.openai.tokenize import TokenizeController
from chatsvc.api.shared.auth import bearer_token, provide_tenant, tenant_for_token
from chatsvc.api.shared.body_limit import body_limit_middleware
from chatsvc.api.shared.body_timeout import body_timeout_middleware
from chatsvc.api.shared.content_type import json_only_middleware
from chatsvc.api.shared.errors import EXCEPTION_HANDLERS
from chatsvc.api.shared.host_check import allowed_hosts_middleware
from chatsvc.api.shared.request_rate import request_rate_middleware
from chatsvc.api.shared.startup_gate import startup_gate_middleware
from chatsvc.config import Settings
from chatsvc.logs import HEADER as REQUEST_ID_HEADER
from chatsvc.logs import RequestIdMiddleware
from chatsvc.service import Services, running_services


def _provide_services(state: State) -> Services:
    return state.services


def _starting(scope: Scope) -> str | None:
    """The start-up phase the app is in, None once its engine serves."""
    services: Services | None = getattr(scope["litestar_app"].state, "services", None)
    return "starting" if services is None else services.not_serving


def _tenant_of(scope: Scope) -> str | None:
    """The tenant id a request acts as (the request-rate key), None when it carries no
    tenant's key (the admin's, a wrong one, none)."""
    services: Services | None = getattr(scope["litestar_app"].state, "services", None)
    if services is None:
        return None
    tenant = tenant_for_token(services, bearer_token(Headers.from_scope(scope)))
    return None if tenant is None else tenant.id


def _rate_limited(scope: Scope, outcome: str) -> None:
    scope["litestar_app"].state.services.metrics.rate_limited.labels(outcome).inc()


def _cors(settings: Settings) -> CORSConfig | None:
    """CORS for the configured origins; None (no CORS header at all) when none are.

    A preflight is answered before any middleware below runs (it carries no key and
    reads nothing); every other request goes through all of them, and its answer, an
    error included, carries the origin when it is allowed, so a page can read it.
    Cookies are never credentials here, so none are allowed."""
    origins = settings.cors_allow_list()
    if not origins:
        return None
    return CORSConfig(
        allow_origins=origins,
        allow_credentials=False,
        expose_headers=[REQUEST_ID_HEADER, PROMPT_CACHE_KEY_HEADER, "Retry-After"],
    )


def create_app(settings: Settings | None = None) -> Litestar:
    """The app for ``settings`` (default: from the environment). Nothing starts until
    the ASGI lifespan does: then Redis and the store come up, and the engine after
    them while the app already answers its probes (service.py)."""
    settings = Settings.from_env() if settings is None else settings.validate()

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        async with running_services(settings) as services:
            app.state.services = services
            yield

    return Litestar(
        route_handlers=[
            healthz,
            readyz,
            SessionController,
            MessageController,
            BranchController,
            SystemPromptController,
            ModelsController,
            ChatCompletionsController,
            CompletionsController,
            TokenizeController,
            ResponsesController,
            ConversationController,
            AdminController,
        ],
        dependencies={
            "services": Provide(_provide_services, sync_to_thread=False),
            "tenant": Provide(provide_tenant),
        },
        exception_handlers=EXCEPTION_HANDLERS,
        cors_config=_cors(settings),
        # Outermost first: the request id is set before anything can log; a foreign
        # Host is refused before any other check looks at the request; nothing but
        # the probes is served before the engine is; a tenant past its request rate
        # is refused before its body is read; an oversized body is drained under the
        # body deadline.
        middleware=[
            RequestIdMiddleware,
            allowed_hosts_middleware(settings.host_allow_list()),
            startup_gate_middleware(_starting),
            request_rate_middleware(
                settings.limits.tenant_requests_per_s,
                settings.limits.tenant_request_burst,
                _tenant_of,
                _rate_limited,
            ),
            body_timeout_middleware(settings.limits.body_read_timeout_s),
            body_limit_middleware(settings.limits.max_body_bytes),
            json_only_middleware,
        ],
        lifespan=[lifespan],
        # Logging is chatsvc.logs' (a request id on every line, written as it is
        # logged). Litestar's own default would replace the root handler with a
        # queue drained by a thread, in its own format: no request ids, and the
        # last lines lost when uvicorn ends a SIGTERM by raising it again.
        logging_config=None,
        request_max_body_size=settings.limits.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="chatsvc",
            version=chatsvc.__version__,
            description="Multi-turn chat with a prefix-caching KV cache; "
            "an OpenAI-compatible API under /v1.",
        ),
    )
