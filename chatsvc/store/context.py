"""What every part of the store shares: one client, the key schema, the scripts, the settings.

Each collaborator of ``Store`` (tenants, prompts, sessions, tree, branches,
responses) holds the one ``StoreContext`` and nothing of the others but what
its constructor names. The client is the seam for deployments: on a
``redis+sentinel://`` URL it is ``sentinel.SentinelRedis``, whose scripts and
writing transactions wait for replicas (WAIT) on their own connection, so no
collaborator knows whether it writes to one server or to a replicated primary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import redis.asyncio as aredis

from chatsvc.store.branch_read import BranchReader
from chatsvc.store.commit import UNBOUNDED, CommitScripts, Quotas
from chatsvc.store.connection import unavailable_on_failure
from chatsvc.store.errors import StorageQuotaError
from chatsvc.store.keys import Keys
from chatsvc.store.path_page import PageReader
from chatsvc.store.presence import ALIVE_TTL_S, Presence

# A conflict means another writer changed what a WATCH guards between our read
# and our write; with the turn lock held that is rare, so a few retries are plenty.
MAX_WATCH_RETRIES = 8


@dataclass(frozen=True)
class StoreContext:
    """The connection and the settings of one ``Store``; build it with ``over``.

    ``session_ttl_s``: idle sessions expire this long after their last use
    (None: never). ``lock_ttl_s``: a turn lock whose holder died frees itself
    after this long, or sooner once its instance's presence key lapses (``presence``:
    this instance's). ``scripts.quotas``: the byte quotas every write is held to.
    """

    redis: aredis.Redis
    url: str
    keys: Keys
    session_ttl_s: float | None
    lock_ttl_s: float
    scripts: CommitScripts
    reader: BranchReader
    pager: PageReader
    presence: Presence

    @classmethod
    def over(
        cls,
        client: aredis.Redis,
        url: str,
        keys: Keys,
        *,
        session_ttl_s: float | None = None,
        lock_ttl_s: float = 30.0,
        quotas: Quotas = UNBOUNDED,
    ) -> StoreContext:
        """The context of ``client`` (connected to ``url``), its scripts registered on it."""
        if session_ttl_s is not None and session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s must be > 0 or None, got {session_ttl_s}")
        if lock_ttl_s <= 0:
            raise ValueError(f"lock_ttl_s must be > 0, got {lock_ttl_s}")
        for name, quota in quotas._asdict().items():
            if quota is not None and (not isinstance(quota, int) or quota < 1):
                raise ValueError(f"{name} must be a positive int or None, got {quota!r}")
        return cls(
            redis=client,
            url=url,
            keys=keys,
            session_ttl_s=session_ttl_s,
            lock_ttl_s=lock_ttl_s,
            scripts=CommitScripts(client, quotas),
            reader=BranchReader(client),
            pager=PageReader(client),
            presence=Presence(client, keys, min(lock_ttl_s, ALIVE_TTL_S)),
        )

    def quota_error(self, outcome: str) -> StorageQuotaError:
        """The error a write refused by ``outcome`` ("session_quota" / "tenant_quota") raises."""
        quotas = self.scripts.quotas
        if outcome == "session_quota":
            limit = f"max_session_bytes={quotas.max_session_bytes}"
            return StorageQuotaError(f"session storage limit ({limit}) reached")
        limit = f"max_tenant_bytes={quotas.max_tenant_bytes}"
        return StorageQuotaError(f"tenant storage limit ({limit}) reached")

    def unavailable(self) -> contextlib.AbstractContextManager[None]:
        """Transport failures inside the block become ``StoreUnavailableError``."""
        return unavailable_on_failure(self.url)

    def ttl_ms(self) -> int | None:
        """The idle TTL in milliseconds, as the scripts take it (None: no expiry)."""
        return None if self.session_ttl_s is None else max(1, int(self.session_ttl_s * 1000))

    async def touch(self, session_id: str) -> None:
        """Push the session's idle expiry out again (a use by its owner)."""
        ttl_ms = self.ttl_ms()
        if ttl_ms is not None:
            async with self.redis.pipeline(transaction=True) as pipe:
                for key in self.keys.session_data_keys(session_id):
                    pipe.pexpire(key, ttl_ms)
                await pipe.execute()
