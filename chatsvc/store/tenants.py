"""Tenants, identified by name: the half of ``Store`` that start-up and auth touch.

A tenant's name (as in ``CHATSVC_API_KEYS``) is its identity: ``p:tenants``
maps each name to the one tenant id it has for ever, so sessions stay with the
name while its key is rotated. Keys themselves never reach Redis; which keys a
replica admits is its own configuration (``chatsvc.tenants``).
"""

from __future__ import annotations

import secrets

from chatsvc.store import validate as v
from chatsvc.store.errors import StoreError
from chatsvc.store.records import TenantRecord, encode, now
from chatsvc.store.sessions import SessionStore

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


class TenantStore(SessionStore):
    """Tenant methods of ``Store``."""

    async def ensure_tenant(self, name: str) -> TenantRecord:
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
        ensure = self.redis.register_script(_ENSURE_TENANT)
        with self._unavailable():
            tenant_id = await ensure(
                keys=[self.keys.tenant_names(), self.keys.tenant(fresh.id)],
                args=[name, fresh.id, encode(fresh)],
            )
            tenant = await self._tenant(tenant_id.decode())
        if tenant is None:
            raise StoreError(f"tenant {name!r} is claimed but its record is missing")
        return tenant

    async def tenant_by_name(self, name: str) -> TenantRecord | None:
        """The tenant called ``name``, or None if there is none yet."""
        if not isinstance(name, str) or not name:
            return None
        with self._unavailable():
            tenant_id = await self.redis.hget(self.keys.tenant_names(), name)
            return None if tenant_id is None else await self._tenant(tenant_id.decode())
