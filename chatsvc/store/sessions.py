"""Sessions and their turns: the half of ``Store`` that a chat turn touches.

Keys per session (all sharing the ``{<sid>}`` hash tag, see keys.py): the
SessionRecord, the message list and the turn lock. With an idle TTL, the record
and the message list expire together; every write and every read by the owner
pushes the expiry out again. The tenant's index (a sorted set by updated_at)
does not expire; ids whose session has expired are pruned from it lazily, when
listing meets them.
"""

from __future__ import annotations

import contextlib
import math
import secrets

import msgspec
import redis.asyncio as aredis
import redis.exceptions as rexc

from chatsvc.store import validate as v
from chatsvc.store.connection import is_transport_error, unavailable_on_failure
from chatsvc.store.errors import NotFoundError, StoreError, StoreUnavailableError
from chatsvc.store.keys import Keys, check_id
from chatsvc.store.listing import (
    MAX_LIST_LIMIT,
    decode_cursor,
    encode_cursor,
    get_many,
    index_after,
)
from chatsvc.store.records import (
    MessageRecord,
    SessionRecord,
    SystemPromptRecord,
    TenantRecord,
    decode,
    encode,
    now,
)

# A WATCH conflict means another writer touched the session between our read
# and EXEC; with the turn lock held that is rare, so a few retries are plenty.
MAX_WATCH_RETRIES = 8


class SessionStore:
    """Session methods of ``Store``; see ``Store.connect`` to build one."""

    def __init__(
        self, client: aredis.Redis, url: str, keys: Keys, *, session_ttl_s: float | None
    ) -> None:
        if session_ttl_s is not None and session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s must be > 0 or None, got {session_ttl_s}")
        self.redis = client
        self.url = url
        self.keys = keys
        self.session_ttl_s = session_ttl_s

    def _unavailable(self) -> contextlib.AbstractContextManager[None]:
        return unavailable_on_failure(self.url)

    # -- shared lookups ------------------------------------------------------

    async def _tenant(self, tenant_id: str) -> TenantRecord | None:
        raw = await self.redis.get(self.keys.tenant(tenant_id))
        return None if raw is None else decode(TenantRecord, raw)

    async def _require_tenant(self, tenant_id: str) -> None:
        check_id("tenant", tenant_id)
        if not await self.redis.exists(self.keys.tenant(tenant_id)):
            raise NotFoundError(f"unknown tenant {tenant_id!r}")

    async def _visible_prompt(self, tenant_id: str, prompt_id: str) -> SystemPromptRecord | None:
        check_id("system prompt", prompt_id)
        raw = await self.redis.get(self.keys.prompt(prompt_id))
        if raw is None:
            return None
        prompt = decode(SystemPromptRecord, raw)
        return prompt if prompt.shared or prompt.tenant_id == tenant_id else None

    async def _visible_session(self, tenant_id: str, session_id: str) -> SessionRecord | None:
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        raw = await self.redis.get(self.keys.session(session_id))
        return self._owned(raw, tenant_id)

    @staticmethod
    def _owned(raw: bytes | None, tenant_id: str) -> SessionRecord | None:
        if raw is None:
            return None
        session = decode(SessionRecord, raw)
        return session if session.tenant_id == tenant_id else None

    def _queue_expiry(self, pipe: aredis.client.Pipeline, session_id: str) -> None:
        if self.session_ttl_s is not None:
            ttl_ms = max(1, int(self.session_ttl_s * 1000))
            for key in self.keys.session_data_keys(session_id):
                pipe.pexpire(key, ttl_ms)

    async def _touch(self, session_id: str) -> None:
        if self.session_ttl_s is not None:
            async with self.redis.pipeline(transaction=True) as pipe:
                self._queue_expiry(pipe, session_id)
                await pipe.execute()

    # -- sessions ------------------------------------------------------------

    async def create_session(
        self,
        tenant_id: str,
        system_prompt_id: str | None,
        system_text: str | None,
        system_token_ids: list[int] | None,
        metadata: dict[str, str] | None,
    ) -> SessionRecord:
        """Start a session for ``tenant_id``.

        ``system_prompt_id`` (optional) must name a prompt the tenant can see.
        ``system_text`` / ``system_token_ids`` are the system turn as the model
        sees it (the API resolves them from the prompt or inline text); when
        ``system_text`` is given it is stored as the first message, role "system".
        The session's ``token_ids`` start as ``system_token_ids``.
        """
        check_id("tenant", tenant_id)
        tokens = (
            []
            if system_token_ids is None
            else v.check_token_ids("system_token_ids", system_token_ids)
        )
        if system_text is not None:
            v.check_text("system_text", system_text)
        meta = v.check_metadata(metadata)
        created = now()
        session = SessionRecord(
            id=secrets.token_hex(16),
            tenant_id=tenant_id,
            system_prompt_id=system_prompt_id,
            metadata=meta,
            created_at=created,
            updated_at=created,
            num_messages=0 if system_text is None else 1,
            token_ids=tokens,
        )
        with self._unavailable():
            await self._require_tenant(tenant_id)
            if system_prompt_id is not None:
                if await self._visible_prompt(tenant_id, system_prompt_id) is None:
                    raise NotFoundError(f"unknown system prompt {system_prompt_id!r}")
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(self.keys.session(session.id), encode(session))
                if system_text is not None:
                    system = MessageRecord(role="system", text=system_text, token_ids=tokens)
                    pipe.rpush(self.keys.session_messages(session.id), encode(system))
                pipe.zadd(self.keys.tenant_sessions(tenant_id), {session.id: created})
                self._queue_expiry(pipe, session.id)
                await pipe.execute()
        return session

    async def get_session(self, tenant_id: str, session_id: str) -> SessionRecord | None:
        """The session, or None if unknown, expired or another tenant's. Refreshes its TTL."""
        with self._unavailable():
            session = await self._visible_session(tenant_id, session_id)
            if session is not None:
                await self._touch(session_id)
        return session

    async def get_messages(self, tenant_id: str, session_id: str) -> list[MessageRecord] | None:
        """Every message of the session, oldest first; None if the session is not visible."""
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        with self._unavailable():
            # One MULTI so the record and the list are read at the same instant.
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.get(self.keys.session(session_id))
                pipe.lrange(self.keys.session_messages(session_id), 0, -1)
                raw, raw_messages = await pipe.execute()
            if self._owned(raw, tenant_id) is None:
                return None
            await self._touch(session_id)
        return [decode(MessageRecord, m) for m in raw_messages]

    async def list_sessions(
        self, tenant_id: str, limit: int = 100, cursor: str | None = None
    ) -> tuple[list[SessionRecord], str | None]:
        """The tenant's sessions, most recently updated first, ``limit`` per page.

        Pass the returned cursor back for the next page; None means no more.
        Ids whose session expired are removed from the index as they are met.
        """
        check_id("tenant", tenant_id)
        if not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
            raise ValueError(f"limit must be an int in [1, {MAX_LIST_LIMIT}], got {limit!r}")
        score, after = (math.inf, None) if cursor is None else decode_cursor(cursor)
        index = self.keys.tenant_sessions(tenant_id)
        page: list[SessionRecord] = []
        expired: list[str] = []
        exhausted = False
        with self._unavailable():
            while len(page) < limit and not exhausted:
                wanted = limit - len(page)
                candidates = await index_after(self.redis, index, score, after, wanted + 1)
                exhausted = len(candidates) <= wanted
                batch = candidates[:wanted]
                raws = await get_many(self.redis, [self.keys.session(sid) for sid, _ in batch])
                for (sid, sid_score), raw in zip(batch, raws, strict=True):
                    score, after = sid_score, sid
                    session = self._owned(raw, tenant_id)
                    if session is None:
                        expired.append(sid)
                    else:
                        page.append(session)
            if expired:
                await self.redis.zrem(index, *expired)
        return page, None if exhausted else encode_cursor(score, after)

    async def count_sessions(self, tenant_id: str) -> int:
        """Size of the tenant's session index: an upper bound, as expired ids
        count until a listing prunes them."""
        check_id("tenant", tenant_id)
        with self._unavailable():
            return await self.redis.zcard(self.keys.tenant_sessions(tenant_id))

    async def delete_session(self, tenant_id: str, session_id: str) -> bool:
        """Remove every key of the session and its index entry; False if not visible."""
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        key = self.keys.session(session_id)
        with self._unavailable():
            for _ in range(MAX_WATCH_RETRIES):
                async with self.redis.pipeline(transaction=True) as pipe:
                    await pipe.watch(key)
                    if self._owned(await pipe.get(key), tenant_id) is None:
                        return False
                    pipe.multi()
                    pipe.delete(*self.keys.session_keys(session_id))
                    pipe.zrem(self.keys.tenant_sessions(tenant_id), session_id)
                    try:
                        await pipe.execute()
                        return True
                    except rexc.WatchError as exc:
                        conflict = exc
        raise self._gave_up(session_id, "delete", conflict)

    async def append_turn(
        self,
        tenant_id: str,
        session_id: str,
        user: MessageRecord,
        assistant: MessageRecord,
        *,
        token_ids: list[int] | None = None,
    ) -> SessionRecord:
        """Append a user and an assistant message in one MULTI/EXEC: all or nothing.

        The session's ``token_ids`` become ``token_ids`` when given (the full
        conversation as the model last saw it, e.g. after a template re-render),
        else the old ones plus the user's and the assistant's token ids.
        ``updated_at``, ``num_messages``, the index score and the TTL move with
        them. Returns the updated session; raises ``NotFoundError`` if the
        session is not visible (deleted, expired, another tenant's).
        """
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        v.check_message("user", user, "user")
        v.check_message("assistant", assistant, "assistant")
        if token_ids is not None:
            token_ids = v.check_token_ids("token_ids", token_ids)
        key = self.keys.session(session_id)
        with self._unavailable():
            for _ in range(MAX_WATCH_RETRIES):
                async with self.redis.pipeline(transaction=True) as pipe:
                    # WATCH: if anything rewrites the record before EXEC, EXEC
                    # applies nothing and we start over from a fresh read.
                    await pipe.watch(key)
                    session = self._owned(await pipe.get(key), tenant_id)
                    if session is None:
                        raise NotFoundError(f"unknown session {session_id!r}")
                    updated = self._after_turn(session, user, assistant, token_ids)
                    pipe.multi()
                    pipe.rpush(
                        self.keys.session_messages(session_id), encode(user), encode(assistant)
                    )
                    pipe.set(key, encode(updated))
                    pipe.zadd(
                        self.keys.tenant_sessions(tenant_id), {session_id: updated.updated_at}
                    )
                    self._queue_expiry(pipe, session_id)
                    try:
                        await pipe.execute()
                        return updated
                    except rexc.WatchError as exc:
                        conflict = exc
        raise self._gave_up(session_id, "append", conflict)

    def _gave_up(self, session_id: str, action: str, conflict: rexc.WatchError) -> StoreError:
        # redis-py turns a connection lost while WATCHing into a WatchError
        # raised from the transport error; that is an outage, not contention.
        if is_transport_error(conflict.__context__):
            return StoreUnavailableError(
                f"lost the connection to redis during {action} of session {session_id!r}; "
                "nothing was written"
            )
        return StoreError(f"session {session_id!r} kept changing during {action}; try again")

    @staticmethod
    def _after_turn(
        session: SessionRecord,
        user: MessageRecord,
        assistant: MessageRecord,
        token_ids: list[int] | None,
    ) -> SessionRecord:
        if token_ids is None:
            token_ids = [*session.token_ids, *user.token_ids, *assistant.token_ids]
        # max(): a replica with a clock behind must not move updated_at backwards.
        updated_at = max(now(), session.updated_at)
        return msgspec.structs.replace(
            session,
            updated_at=updated_at,
            num_messages=session.num_messages + 2,
            token_ids=token_ids,
        )
