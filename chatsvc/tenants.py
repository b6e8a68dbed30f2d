"""Whom this replica admits: the keys of its own settings, each resolved to a tenant by name.

Configured keys are the only truth. Redis holds tenants (by name) but no keys,
so rotating a key in ``CHATSVC_API_KEYS`` keeps the tenant and its sessions,
and removing an entry makes its key answer 401 at once, whatever Redis holds.
Replicas that share one Redis each admit exactly their own keys; during a
rolling rotation the old and the new key both reach the same tenant, each on
the replicas configured with it.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from chatsvc.store import hash_api_key
from chatsvc.store.records import TenantRecord
from chatsvc.store.validate import check_api_key


@dataclass(frozen=True)
class TenantDirectory:
    """The tenants of this replica's keys, or the one local tenant when auth is off."""

    # (sha256 hex of a configured key, its tenant); the keys themselves are not kept.
    entries: tuple[tuple[str, TenantRecord], ...] = ()
    local: TenantRecord | None = None

    @classmethod
    def of_keys(cls, tenants: list[tuple[str, TenantRecord]]) -> TenantDirectory:
        """A directory of ``(api_key, tenant)`` pairs; raises ``ValueError`` for a weak key."""
        return cls(entries=tuple((hash_api_key(check_api_key(k)), t) for k, t in tenants))

    def tenant_for_key(self, api_key: str) -> TenantRecord | None:
        """The tenant ``api_key`` opens on this replica, or None."""
        if not isinstance(api_key, str) or not api_key:
            return None
        key_hash = hash_api_key(api_key)
        found = None
        # Every entry is compared, each in constant time: how long the check
        # takes says nothing about which key, or how much of one, matched.
        for known, tenant in self.entries:
            if hmac.compare_digest(known, key_hash):
                found = tenant
        return found
