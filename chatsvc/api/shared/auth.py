"""Who is calling: the tenant behind a Bearer key, or the admin.

With no API keys configured the service runs as a local tool (loopback only,
enforced by Settings) and every request acts as the one local tenant.
"""

from __future__ import annotations

import hmac

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from chatsvc.api.shared.deps import ServicesDep
from chatsvc.api.shared.errors import AuthenticationError, PermissionDeniedError
from chatsvc.service import Services
from chatsvc.store.records import TenantRecord


def bearer_token(headers: dict[str, str] | object) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    value = headers.get("authorization")  # type: ignore[attr-defined]
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def provide_tenant(request: Request, services: ServicesDep) -> TenantRecord:
    """Dependency: the calling tenant, or 401 (same answer for a missing and a wrong key).

    Only this replica's configured keys admit anyone (``services.tenants``);
    nothing in Redis can add, keep or revive a key.
    """
    token = bearer_token(request.headers)
    tenant = tenant_for_token(services, token)
    if tenant is None:
        if token is None:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        raise AuthenticationError("invalid API key")
    return tenant


def tenant_for_token(services: Services, token: str | None) -> TenantRecord | None:
    """The tenant a request bearing ``token`` acts as: the local tenant when the service
    runs without keys, else the key's (None: no token, or a key this replica does not
    know). Shared by the dependency above and the request-rate check."""
    if services.tenants.local is not None:
        return services.tenants.local
    return None if token is None else services.tenants.tenant_for_key(token)


def admin_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """Guard of admin routes: the admin key, or the local mode (loopback, no keys at all)."""
    services: Services = connection.app.state.services
    settings = services.settings
    if not settings.auth_enabled and settings.admin_key is None:
        return
    token = bearer_token(connection.headers)
    if token is None:
        raise AuthenticationError("missing admin key: send 'Authorization: Bearer <admin key>'")
    if settings.admin_key is None:
        raise PermissionDeniedError("admin endpoints are disabled: CHATSVC_ADMIN_KEY is not set")
    if not hmac.compare_digest(token.encode(), settings.admin_key.encode()):
        raise PermissionDeniedError("not the admin key")
