"""The session store: tenants, system prompts, sessions and their turns in Redis.

One ``Store`` per process, shared by every request. Ids handed in by callers
are checked before use; an id that belongs to another tenant behaves exactly
like an unknown one (None / False / NotFoundError), so ids leak nothing.
Tenants live in ``tenants.py``, system prompts in ``prompts.py``, sessions in
``sessions.py``, their writes in ``writes.py`` and ``branches.py``, responses in
``responses.py``; this class joins them with the connection and the lock.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator

import redis.asyncio as aredis

from chatsvc.store.connection import make_client, unavailable_on_failure
from chatsvc.store.errors import NotFoundError, SessionBusyError
from chatsvc.store.keys import Keys
from chatsvc.store.lock import RedisLock, keep_held
from chatsvc.store.prompts import PromptStore
from chatsvc.store.responses import ResponseStore
from chatsvc.store.schema import apply_pending
from chatsvc.store.tenants import TenantStore


def hash_api_key(api_key: str) -> str:
    """Hex sha256 of an API key: what key lookups compare (the key itself is kept nowhere)."""
    return hashlib.sha256(api_key.encode()).hexdigest()


class Store(ResponseStore, PromptStore, TenantStore):
    """Tenants (``TenantStore``), system prompts (``PromptStore``), sessions
    (``SessionStore``, their common base), their writes and branches
    (``TreeStore``, ``BranchStore``) and stored responses (``ResponseStore``)
    over one connection pool."""

    def __init__(
        self,
        client: aredis.Redis,
        url: str,
        keys: Keys,
        *,
        session_ttl_s: float | None = None,
        lock_ttl_s: float = 30.0,
    ) -> None:
        super().__init__(client, url, keys, session_ttl_s=session_ttl_s)
        if lock_ttl_s <= 0:
            raise ValueError(f"lock_ttl_s must be > 0, got {lock_ttl_s}")
        self.lock_ttl_s = lock_ttl_s

    @classmethod
    async def connect(
        cls,
        url: str,
        prefix: str = "chatsvc",
        session_ttl_s: float | None = None,
        *,
        lock_ttl_s: float = 30.0,
        socket_timeout_s: float = 2.0,
        client_name: str | None = None,
    ) -> Store:
        """Connect to ``url``, apply pending migrations under a lock, return the store.

        ``session_ttl_s``: idle sessions expire this long after their last use
        (None: never). ``lock_ttl_s``: a turn lock whose holder died frees itself
        after this long. Raises ``StoreUnavailableError`` if Redis is unreachable.
        """
        keys = Keys(prefix)
        client = make_client(url, socket_timeout_s=socket_timeout_s, client_name=client_name)
        try:
            store = cls(client, url, keys, session_ttl_s=session_ttl_s, lock_ttl_s=lock_ttl_s)
            with unavailable_on_failure(url):
                await client.ping()
                await apply_pending(client, keys)
        except BaseException:
            await client.aclose()
            raise
        return store

    async def close(self) -> None:
        """Close the connection pool; the store is unusable afterwards."""
        await self.redis.aclose()

    # -- turn lock -----------------------------------------------------------

    @contextlib.asynccontextmanager
    async def turn_lock(self, tenant_id: str, session_id: str) -> AsyncIterator[RedisLock]:
        """Hold the session's turn lock for the block: one turn at a time per session.

        Yields the lock, which ``append_turn`` needs: a turn commits only while
        its lock is still the session's (fencing). Raises ``NotFoundError`` for
        an unknown (or another tenant's) session and ``SessionBusyError`` if a
        turn is already running. The lock is extended while the block runs,
        released when it exits (also on exceptions), and expires after
        ``lock_ttl_s`` if this process dies or stalls for that long.
        """
        with self._unavailable():
            if await self._visible_session(tenant_id, session_id) is None:
                raise NotFoundError(f"unknown session {session_id!r}")
            lock = RedisLock(self.redis, self.keys.session_lock(session_id), self.lock_ttl_s)
            acquired = await lock.acquire()
        if not acquired:
            raise SessionBusyError(f"session {session_id!r} is already running a turn")
        async with keep_held(lock):
            yield lock
