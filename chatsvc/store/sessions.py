"""Sessions: creating, reading, listing and deleting them, and the turn lock.

Keys per session (all sharing the ``{<sid>}`` hash tag, see keys.py): the
summary, the active branch's token history, the message tree (records, child
lists, active path), the stored responses, the ids of recently applied writes
and the turn lock. With an idle TTL, all but the lock expire together; every
write and every read by the owner pushes the expiry out again. The tenant's
index (a sorted set by updated_at) and its byte counters (commit.py) do not
expire; ids whose session has expired are pruned from both lazily, when
listing meets them or when a write is refused at the tenant's byte quota.

Creating a session and every later write are Lua scripts (``commit.py``):
each is fenced, idempotent and atomic. The later writes live in writes.py,
branches.py and responses.py; reads of the message tree in tree_read.py.
"""

from __future__ import annotations

import contextlib
import math
import secrets
from collections.abc import AsyncIterator

import redis.exceptions as rexc

from chatsvc.store import validate as v
from chatsvc.store.commit import TOTAL, NewSession, SessionKeys
from chatsvc.store.connection import is_transport_error
from chatsvc.store.context import MAX_WATCH_RETRIES, StoreContext
from chatsvc.store.errors import (
    LimitExceededError,
    NotFoundError,
    SessionBusyError,
    StoreError,
    StoreUnavailableError,
)
from chatsvc.store.keys import check_id
from chatsvc.store.listing import MAX_LIST_LIMIT, READ_CHUNK, decode_cursor, get_many, read_page
from chatsvc.store.lock import RedisLock, keep_held
from chatsvc.store.prompts import Prompts
from chatsvc.store.records import (
    SESSION_KINDS,
    MessageRecord,
    ResponseRecord,
    SessionRecord,
    SessionSummary,
    decode,
    decode_tokens,
    encode,
    encode_tokens,
    now,
)
from chatsvc.store.tenants import Tenants
from chatsvc.store.tree import ROOT, branch_tokens, chain_children, link_chain


async def forget(context: StoreContext, tenant_id: str, session_ids: list[str]) -> None:
    """Drop expired sessions from the tenant's index, and their bytes from its total.

    Expired sessions leave both behind (the tenant's keys do not expire); a session
    whose summary is there (not expired after all) is left alone.
    """
    keys = context.keys
    await context.scripts.forget(
        keys.tenant_sessions(tenant_id),
        keys.tenant_bytes(tenant_id),
        {sid: keys.session(sid) for sid in session_ids},
    )


async def forget_all_expired(context: StoreContext, tenant_id: str) -> None:
    """``forget`` every expired session of the tenant: what a write refused at the
    tenant's quota runs before trying again, as expired bytes may be holding it."""
    if context.session_ttl_s is None:
        return  # nothing expires: every session that went took its bytes with it
    index = context.keys.tenant_sessions(tenant_id)
    ids = [member.decode() for member in await context.redis.zrange(index, 0, -1)]
    for start in range(0, len(ids), READ_CHUNK):
        chunk = ids[start : start + READ_CHUNK]
        summaries = await get_many(context.redis, [context.keys.session(sid) for sid in chunk])
        gone = [sid for sid, raw in zip(chunk, summaries, strict=True) if raw is None]
        if gone:
            await forget(context, tenant_id, gone)


def owned(raw: bytes | None, tenant_id: str) -> SessionSummary | None:
    """The summary stored as ``raw`` if ``tenant_id`` owns it; None for a missing or
    foreign one, so another tenant's session reads exactly like an unknown id."""
    if raw is None:
        return None
    session = decode(SessionSummary, raw)
    return session if session.tenant_id == tenant_id else None


class Sessions:
    """``store.sessions``: a session as a whole, and the lock its turns take."""

    def __init__(self, context: StoreContext, tenants: Tenants, prompts: Prompts) -> None:
        self._ctx = context
        self._tenants = tenants
        self._prompts = prompts

    async def create(
        self,
        tenant_id: str,
        system_prompt_id: str | None,
        system_text: str | None,
        system_token_ids: list[int] | None,
        metadata: dict[str, str] | None,
        *,
        messages: list[MessageRecord] = (),
        kind: str = "session",
        response: ResponseRecord | None = None,
        session_id: str | None = None,
        max_sessions: int | None = None,
    ) -> SessionRecord:
        """Start a session for ``tenant_id``.

        ``system_prompt_id`` (optional) must name a prompt the tenant can see.
        ``system_text`` / ``system_token_ids`` are the system turn as the model
        sees it (the API resolves them from the prompt or inline text); when
        ``system_text`` is given it is stored as the first message, role "system".
        The session's ``token_ids`` start as ``system_token_ids``.

        ``messages`` follow (one branch, in order; a conversation's initial items,
        or a first response's input and answer, whose ``response`` record is
        stored with them); their ``token_ids`` continue the history. ``kind`` says
        which API made the session; ``session_id`` is for callers that named the
        session before writing it (a response's id carries it). One atomic write;
        sent again after a lost reply, it creates nothing more. ``StorageQuotaError``
        (nothing written) if it would pass a byte quota.

        ``max_sessions``: the most sessions the tenant may have (None: no cap); at
        it, ``LimitExceededError`` and nothing is written. The count and the write
        are one step, so concurrent creates cannot pass the cap together. Expired
        sessions count until a listing prunes them (as in ``count``).
        """
        check_id("tenant", tenant_id)
        if kind not in SESSION_KINDS:
            raise ValueError(f"kind must be one of {sorted(SESSION_KINDS)}, got {kind!r}")
        tokens = (
            []
            if system_token_ids is None
            else v.check_token_ids("system_token_ids", system_token_ids)
        )
        if system_text is not None:
            v.check_text("system_text", system_text)
        elif tokens:
            # The history is its messages' tokens: tokens need the message they belong to.
            raise ValueError("system_token_ids need a system_text")
        meta = v.check_metadata(metadata)
        chain = []
        if system_text is not None:
            chain.append(MessageRecord(role="system", text=system_text, token_ids=tokens))
        for i, message in enumerate(messages):
            v.check_message(f"messages[{i}]", message, message.role)
            chain.append(message)
        chain = link_chain(chain, parent_id=None)
        history = branch_tokens(chain)
        created = now()
        session = SessionRecord(
            id=secrets.token_hex(16) if session_id is None else check_id("session", session_id),
            tenant_id=tenant_id,
            system_prompt_id=system_prompt_id,
            metadata=meta,
            created_at=created,
            updated_at=created,
            num_messages=len(chain),
            token_ids=history,
            active_leaf=chain[-1].id if chain else None,
            num_nodes=len(chain),
            kind=kind,
        )
        new = NewSession(
            summary=encode(session.summary()),
            tokens=encode_tokens(history),
            node_sets={m.id: encode(m) for m in chain},
            child_sets=chain_children(chain, parent_key=ROOT, existing=[]),
            path=[m.id for m in chain],
        )
        if response is not None:
            new.response_sets[response.id] = encode(response)
        with self._ctx.unavailable():
            await self._tenants.require(tenant_id)
            if system_prompt_id is not None:
                if await self._prompts.get(tenant_id, system_prompt_id) is None:
                    raise NotFoundError(f"unknown system prompt {system_prompt_id!r}")
            for attempt in range(2):
                outcome = await self._ctx.scripts.create(
                    SessionKeys.of(self._ctx.keys, tenant_id, session.id),
                    new,
                    session_id=session.id,
                    score=created,
                    ttl_ms=self._ctx.ttl_ms(),
                    max_sessions=max_sessions,
                )
                if outcome != "tenant_quota" or attempt or self._ctx.session_ttl_s is None:
                    break
                # Expired sessions may be what holds the tenant at its quota.
                await forget_all_expired(self._ctx, tenant_id)
        if outcome == "limit":
            raise LimitExceededError(f"this tenant already has {max_sessions} sessions")
        if outcome in ("session_quota", "tenant_quota"):
            raise self._ctx.quota_error(outcome)
        return session

    async def get(self, tenant_id: str, session_id: str) -> SessionRecord | None:
        """The session, or None if unknown, expired or another tenant's. Refreshes its TTL."""
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        with self._ctx.unavailable():
            session = await self._read(tenant_id, session_id)
            if session is not None:
                await self._ctx.touch(session_id)
        return session

    async def peek(self, tenant_id: str, session_id: str) -> SessionRecord | None:
        """Like ``get`` but leaves its TTL alone: a read on another session's behalf."""
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        with self._ctx.unavailable():
            return await self._read(tenant_id, session_id)

    async def _read(self, tenant_id: str, session_id: str) -> SessionRecord | None:
        # One MULTI so the summary and the token history are read at the same instant.
        async with self._ctx.redis.pipeline(transaction=True) as pipe:
            pipe.get(self._ctx.keys.session(session_id))
            pipe.get(self._ctx.keys.session_tokens(session_id))
            raw, raw_tokens = await pipe.execute()
        summary = owned(raw, tenant_id)
        if summary is None:
            return None
        tokens = [] if raw_tokens is None else decode_tokens(raw_tokens)
        return SessionRecord.from_summary(summary, tokens)

    async def list_page(
        self,
        tenant_id: str,
        limit: int = 100,
        cursor: str | None = None,
        *,
        max_bytes: int | None = None,
    ) -> tuple[list[SessionSummary], str | None]:
        """The tenant's sessions as summaries (no token ids), most recently updated first.

        A page ends after ``limit`` sessions, or earlier where the next summary
        would take the page's JSON size past ``max_bytes`` (None: no byte
        bound); a page always holds at least one session if any is left. Pass
        the returned cursor back for the next page; None means no more. Ids
        whose session expired are removed from the index as they are met.
        """
        check_id("tenant", tenant_id)
        if not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
            raise ValueError(f"limit must be an int in [1, {MAX_LIST_LIMIT}], got {limit!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        after = (math.inf, None) if cursor is None else decode_cursor(cursor)
        index = self._ctx.keys.tenant_sessions(tenant_id)
        with self._ctx.unavailable():
            page = await read_page(
                self._ctx.redis,
                index,
                self._ctx.keys.session,
                lambda raw: owned(raw, tenant_id),
                after=after,
                limit=limit,
                max_bytes=max_bytes,
            )
            if page.expired:
                await forget(self._ctx, tenant_id, page.expired)
        return page.summaries, page.next_cursor

    async def storage(self, tenant_id: str, session_id: str | None) -> tuple[int, int]:
        """The bytes the session (None: a session not written yet, 0) and its tenant store."""
        check_id("tenant", tenant_id)
        fields = [TOTAL if session_id is None else check_id("session", session_id), TOTAL]
        with self._ctx.unavailable():
            raws = await self._ctx.redis.hmget(self._ctx.keys.tenant_bytes(tenant_id), fields)
        session_bytes, tenant_bytes = (int(raw or 0) for raw in raws)
        return (0 if session_id is None else session_bytes), tenant_bytes

    async def bytes_used(self, tenant_id: str) -> int:
        """The bytes the tenant's sessions store (expired ones included until a listing
        prunes them): what ``max_tenant_bytes`` bounds."""
        check_id("tenant", tenant_id)
        with self._ctx.unavailable():
            raw = await self._ctx.redis.hget(self._ctx.keys.tenant_bytes(tenant_id), TOTAL)
        return int(raw or 0)

    async def count(self, tenant_id: str) -> int:
        """Size of the tenant's session index: an upper bound, as expired ids
        count until a listing prunes them."""
        check_id("tenant", tenant_id)
        with self._ctx.unavailable():
            return await self._ctx.redis.zcard(self._ctx.keys.tenant_sessions(tenant_id))

    async def delete(self, tenant_id: str, session_id: str) -> bool:
        """Remove every key of the session, its index entry and its byte count (off the
        tenant's total); False if not visible."""
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        keys = self._ctx.keys
        key = keys.session(session_id)
        with self._ctx.unavailable():
            for _ in range(MAX_WATCH_RETRIES):
                async with self._ctx.redis.pipeline(transaction=True) as pipe:
                    # Every write that changes the session's byte count rewrites its
                    # summary, so watching the summary guards the count read here too.
                    await pipe.watch(key)
                    if owned(await pipe.get(key), tenant_id) is None:
                        return False
                    counters = keys.tenant_bytes(tenant_id)
                    freed = int(await pipe.hget(counters, session_id) or 0)
                    pipe.multi()
                    pipe.delete(*keys.session_keys(session_id))
                    pipe.zrem(keys.tenant_sessions(tenant_id), session_id)
                    pipe.hdel(counters, session_id)
                    pipe.hincrby(counters, TOTAL, -freed)
                    try:
                        await pipe.execute()
                        return True
                    except rexc.WatchError as exc:
                        conflict = exc
        raise _gave_up(session_id, "delete", conflict)

    @contextlib.asynccontextmanager
    async def turn_lock(self, tenant_id: str, session_id: str) -> AsyncIterator[RedisLock]:
        """Hold the session's turn lock for the block: one turn at a time per session.

        Yields the lock, which every write to the session needs (``Branches``,
        ``Responses``): a write commits only while its lock is still the
        session's (fencing). Raises ``NotFoundError`` for an unknown (or another
        tenant's) session and ``SessionBusyError`` if a turn is already running.
        The lock is extended while the block runs, released when it exits (also
        on exceptions), and expires after ``lock_ttl_s`` if this process dies or
        stalls for that long; a turn of another instance takes it over sooner, once this
        instance's presence key has lapsed (``presence.py``).
        """
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        keys = self._ctx.keys
        with self._ctx.unavailable():
            # The ownership check comes first, so a busy lock never reveals another
            # tenant's session.
            if owned(await self._ctx.redis.get(keys.session(session_id)), tenant_id) is None:
                raise NotFoundError(f"unknown session {session_id!r}")
            lock = RedisLock(
                self._ctx.redis,
                keys.session_lock(session_id),
                self._ctx.lock_ttl_s,
                self._ctx.presence,
            )
            acquired = await lock.acquire()
        if not acquired:
            raise SessionBusyError(f"session {session_id!r} is already running a turn")
        async with keep_held(lock):
            yield lock


def _gave_up(session_id: str, action: str, conflict: rexc.WatchError) -> StoreError:
    # redis-py turns a connection lost while WATCHing into a WatchError
    # raised from the transport error; that is an outage, not contention.
    if is_transport_error(conflict.__context__):
        return StoreUnavailableError(
            f"lost the connection to redis during {action} of session {session_id!r}; "
            "nothing was written"
        )
    return StoreError(f"session {session_id!r} kept changing during {action}; try again")
