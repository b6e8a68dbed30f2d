"""Tenants, identified by name: the part of the store that start-up and auth touch.

A tenant's name (as in ``CHATSVC_API_KEYS``) is its identity: ``p:tenants``
maps each name to the one tenant id it has for ever, so sessions stay with the
name while its key is rotated. Keys themselves never reach Redis; which keys a
replica admits is its own configuration (``chatsvc.tenants``).
"""

from __future__ import annotations

import hashlib
import secrets

from chatsvc.store import validate as v
from chatsvc.store.context import StoreContext
from chatsvc.store.errors import NotFoundError, StoreError
from chatsvc.store.keys import check_id
from chatsvc.store.records import TenantRecord, decode, encode, now

# Create-if-absent in one step, so replicas starting together agree on one id:
# the first to run writes the record and claims the name, the others get its id.
_ENSURE_TENANT = """
local existing = redis.call('hget', KEYS[1], ARGV[1])
if existing then
    return existing
end
redis.call('set', KEYS[2], ARGV[3])
redis.call('hset', KEYS[1], ARGV[1], ARGV[2])
return ARGV[2]
"""


def hash_api_key(api_key: str) -> str:
    """Hex sha256 of an API key: what a replica's key lookups compare (``chatsvc.tenants``;
    the key itself is kept nowhere)."""
    return hashlib.sha256(api_key.encode()).hexdigest()


class Tenants:
    """``store.tenants``: tenant records and the names that claim them."""

    def __init__(self, context: StoreContext) -> None:
        self._ctx = context
        self._ensure = context.redis.register_script(_ENSURE_TENANT)

    async def ensure(self, name: str) -> TenantRecord:
        """The tenant called ``name``, created (with a fresh id and salt) if there is none.

        Idempotent and safe to race: every caller gets the same tenant, and only
        one record is ever written for a name. Raises ``InvalidInputError`` for a blank
        or overlong name.
        """
        v.check_name("name", name)
        fresh = TenantRecord(
            id=secrets.token_hex(16),
            name=name,
            cache_salt=secrets.token_bytes(32),
            created_at=now(),
        )
        keys = self._ctx.keys
        with self._ctx.unavailable():
            tenant_id = await self._ensure(
                keys=[keys.tenant_names(), keys.tenant(fresh.id)],
                args=[name, fresh.id, encode(fresh)],
            )
            tenant = await self._get(tenant_id.decode())
        if tenant is None:
            raise StoreError(f"tenant {name!r} is claimed but its record is missing")
        return tenant

    async def by_name(self, name: str) -> TenantRecord | None:
        """The tenant called ``name``, or None if there is none yet."""
        if not isinstance(name, str) or not name:
            return None
        with self._ctx.unavailable():
            tenant_id = await self._ctx.redis.hget(self._ctx.keys.tenant_names(), name)
            return None if tenant_id is None else await self._get(tenant_id.decode())

    async def require(self, tenant_id: str) -> None:
        """Raise ``NotFoundError`` unless ``tenant_id`` is a tenant (what owning anything needs)."""
        check_id("tenant", tenant_id)
        with self._ctx.unavailable():
            if not await self._ctx.redis.exists(self._ctx.keys.tenant(tenant_id)):
                raise NotFoundError(f"unknown tenant {tenant_id!r}")

    async def _get(self, tenant_id: str) -> TenantRecord | None:
        raw = await self._ctx.redis.get(self._ctx.keys.tenant(tenant_id))
        return None if raw is None else decode(TenantRecord, raw)
