"""The session store: tenants, system prompts, sessions and their turns in Redis.

One ``Store`` per process, shared by every request. Ids handed in by callers
are checked before use; an id that belongs to another tenant behaves exactly
like an unknown one (None / False / NotFoundError), so ids leak nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
from collections.abc import AsyncIterator

import redis.asyncio as aredis

from chatsvc.store import validate as v
from chatsvc.store.connection import make_client, unavailable_on_failure
from chatsvc.store.errors import NotFoundError, SessionBusyError
from chatsvc.store.keys import Keys, check_id
from chatsvc.store.lock import RedisLock, keep_held
from chatsvc.store.records import SystemPromptRecord, TenantRecord, decode, encode, now
from chatsvc.store.sessions import SessionStore
from migrations.runner import apply_pending


def hash_api_key(api_key: str) -> str:
    """Hex sha256 of an API key: what is stored, and what lookups are keyed by."""
    return hashlib.sha256(api_key.encode()).hexdigest()


class Store(SessionStore):
    """Tenants and system prompts here; sessions and turns in ``SessionStore``."""

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

    # -- tenants -------------------------------------------------------------

    async def create_tenant(self, name: str, api_key: str) -> TenantRecord:
        """Register a tenant whose requests authenticate with ``api_key``.

        Raises ``ValueError`` if the key is too short or already registered.
        """
        v.check_name("name", name)
        key_hash = hash_api_key(v.check_api_key(api_key))
        tenant = TenantRecord(
            id=secrets.token_hex(16),
            name=name,
            api_key_hash=key_hash,
            cache_salt=secrets.token_bytes(32),
            created_at=now(),
        )
        key_key = self.keys.api_key(key_hash)
        with self._unavailable():
            async with self.redis.pipeline(transaction=True) as pipe:
                # WATCH makes the existence check and the writes one atomic step.
                await pipe.watch(key_key)
                if await pipe.exists(key_key):
                    raise ValueError("this API key is already registered")
                pipe.multi()
                pipe.set(self.keys.tenant(tenant.id), encode(tenant))
                pipe.set(key_key, tenant.id)
                await pipe.execute()
        return tenant

    async def tenant_by_api_key(self, api_key: str) -> TenantRecord | None:
        """The tenant owning ``api_key``, or None for an unknown key."""
        if not isinstance(api_key, str) or not api_key:
            return None
        key_hash = hash_api_key(api_key)
        with self._unavailable():
            tenant_id = await self.redis.get(self.keys.api_key(key_hash))
            if tenant_id is None:
                return None
            tenant = await self._tenant(tenant_id.decode())
        if tenant is None or not hmac.compare_digest(tenant.api_key_hash, key_hash):
            return None
        return tenant

    async def get_tenant(self, tenant_id: str) -> TenantRecord | None:
        """The tenant with this id, or None."""
        check_id("tenant", tenant_id)
        with self._unavailable():
            return await self._tenant(tenant_id)

    # -- system prompts ------------------------------------------------------

    async def create_system_prompt(
        self, tenant_id: str, name: str, text: str, token_ids: list[int], shared: bool
    ) -> SystemPromptRecord:
        """Store a system prompt owned by ``tenant_id``; ``shared`` makes it visible to all."""
        v.check_name("name", name)
        v.check_text("text", text, allow_empty=False)
        tokens = v.check_token_ids("token_ids", token_ids)
        if not isinstance(shared, bool):
            raise TypeError(f"shared must be a bool, got {type(shared).__name__}")
        prompt = SystemPromptRecord(
            id=secrets.token_hex(16),
            tenant_id=tenant_id,
            name=name,
            text=text,
            token_ids=tokens,
            shared=shared,
            created_at=now(),
        )
        with self._unavailable():
            await self._require_tenant(tenant_id)
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(self.keys.prompt(prompt.id), encode(prompt))
                pipe.sadd(self.keys.tenant_prompts(tenant_id), prompt.id)
                if shared:
                    pipe.sadd(self.keys.shared_prompts(), prompt.id)
                await pipe.execute()
        return prompt

    async def get_system_prompt(self, tenant_id: str, prompt_id: str) -> SystemPromptRecord | None:
        """The prompt if ``tenant_id`` owns it or it is shared; else None."""
        check_id("tenant", tenant_id)
        with self._unavailable():
            return await self._visible_prompt(tenant_id, prompt_id)

    async def list_system_prompts(self, tenant_id: str) -> list[SystemPromptRecord]:
        """The tenant's own prompts and every shared one, oldest first."""
        check_id("tenant", tenant_id)
        with self._unavailable():
            ids = await self.redis.sunion(
                [self.keys.tenant_prompts(tenant_id), self.keys.shared_prompts()]
            )
            ordered = sorted(i.decode() for i in ids)
            raws = await self.redis.mget([self.keys.prompt(i) for i in ordered]) if ids else []
        prompts = [decode(SystemPromptRecord, raw) for raw in raws if raw is not None]
        return sorted(prompts, key=lambda p: (p.created_at, p.id))

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
