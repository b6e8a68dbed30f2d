"""Sessions and their turns: the half of ``Store`` that a chat turn touches.

Keys per session (all sharing the ``{<sid>}`` hash tag, see keys.py): the
summary, the active branch's token history, the message tree (records, child
lists, active path), the stored responses, the ids of recently applied writes
and the turn lock. With an idle TTL, all but the lock expire together; every
write and every read by the owner pushes the expiry out again. The tenant's
index (a sorted set by updated_at) does not expire; ids whose session has
expired are pruned from it lazily, when listing meets them.

Creating a session and every later write are Lua scripts (``commit.py``):
each is fenced, idempotent and atomic. The writes live in writes.py and branches.py.
"""

from __future__ import annotations

import contextlib
import math
import secrets

import redis.asyncio as aredis
import redis.exceptions as rexc

from chatsvc.store import validate as v
from chatsvc.store.branch_read import Branch, BranchReader, UnknownMessage
from chatsvc.store.commit import CommitScripts, NewSession, SessionKeys
from chatsvc.store.connection import is_transport_error, unavailable_on_failure
from chatsvc.store.errors import (
    NotFoundError,
    StoreError,
    StoreUnavailableError,
)
from chatsvc.store.keys import Keys, check_id
from chatsvc.store.listing import MAX_LIST_LIMIT, decode_cursor, read_page
from chatsvc.store.records import (
    SESSION_KINDS,
    MessageRecord,
    ResponseRecord,
    SessionRecord,
    SessionSummary,
    SystemPromptRecord,
    TenantRecord,
    decode,
    decode_tokens,
    encode,
    encode_tokens,
    now,
)
from chatsvc.store.tree import ROOT, branch_tokens, chain_children, link_chain

# A conflict means another writer changed the session between our read and our
# write; with the turn lock held that is rare, so a few retries are plenty.
MAX_WATCH_RETRIES = 8
MAX_TURN_ID_CHARS = 128


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
        self._scripts = CommitScripts(client)
        self._reader = BranchReader(client)

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

    async def _visible_session(self, tenant_id: str, session_id: str) -> SessionSummary | None:
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        raw = await self.redis.get(self.keys.session(session_id))
        return self._owned(raw, tenant_id)

    @staticmethod
    def _owned(raw: bytes | None, tenant_id: str) -> SessionSummary | None:
        if raw is None:
            return None
        session = decode(SessionSummary, raw)
        return session if session.tenant_id == tenant_id else None

    def _session_keys(self, tenant_id: str, session_id: str) -> SessionKeys:
        return SessionKeys(
            summary=self.keys.session(session_id),
            tokens=self.keys.session_tokens(session_id),
            nodes=self.keys.session_nodes(session_id),
            children=self.keys.session_children(session_id),
            path=self.keys.session_path(session_id),
            responses=self.keys.session_responses(session_id),
            commits=self.keys.session_commits(session_id),
            lock=self.keys.session_lock(session_id),
            index=self.keys.tenant_sessions(tenant_id),
        )

    async def _read_branch(
        self, tenant_id: str, session_id: str, leaf: str | None = None
    ) -> Branch | None:
        """The branch ending at ``leaf`` (None: the active one); None if the session is
        not visible; ``NotFoundError`` if it holds no such message."""
        k = self.keys
        keys = (
            k.session(session_id),
            k.session_path(session_id),
            k.session_nodes(session_id),
            k.session_children(session_id),
            k.session_tokens(session_id),
        )
        try:
            return await self._reader.read(keys, tenant_id, leaf)
        except UnknownMessage:
            raise NotFoundError(f"unknown message {leaf!r}") from None

    def _ttl_ms(self) -> int | None:
        return None if self.session_ttl_s is None else max(1, int(self.session_ttl_s * 1000))

    async def _touch(self, session_id: str) -> None:
        ttl_ms = self._ttl_ms()
        if ttl_ms is not None:
            async with self.redis.pipeline(transaction=True) as pipe:
                for key in self.keys.session_data_keys(session_id):
                    pipe.pexpire(key, ttl_ms)
                await pipe.execute()

    # -- sessions ------------------------------------------------------------

    async def create_session(
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
        sent again after a lost reply, it creates nothing more.
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
        with self._unavailable():
            await self._require_tenant(tenant_id)
            if system_prompt_id is not None:
                if await self._visible_prompt(tenant_id, system_prompt_id) is None:
                    raise NotFoundError(f"unknown system prompt {system_prompt_id!r}")
            await self._scripts.create(
                self._session_keys(tenant_id, session.id),
                new,
                session_id=session.id,
                score=created,
                ttl_ms=self._ttl_ms(),
            )
        return session

    async def get_session(self, tenant_id: str, session_id: str) -> SessionRecord | None:
        """The session, or None if unknown, expired or another tenant's. Refreshes its TTL."""
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        with self._unavailable():
            session = await self._read_session(tenant_id, session_id)
            if session is not None:
                await self._touch(session_id)
        return session

    async def peek_session(self, tenant_id: str, session_id: str) -> SessionRecord | None:
        """Like ``get_session`` but leaves its TTL alone: a read on another session's behalf."""
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        with self._unavailable():
            return await self._read_session(tenant_id, session_id)

    async def _read_session(self, tenant_id: str, session_id: str) -> SessionRecord | None:
        # One MULTI so the summary and the token history are read at the same instant.
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.get(self.keys.session(session_id))
            pipe.get(self.keys.session_tokens(session_id))
            raw, raw_tokens = await pipe.execute()
        summary = self._owned(raw, tenant_id)
        if summary is None:
            return None
        tokens = [] if raw_tokens is None else decode_tokens(raw_tokens)
        return SessionRecord.from_summary(summary, tokens)

    async def get_messages(self, tenant_id: str, session_id: str) -> list[MessageRecord] | None:
        """The messages of the active branch, oldest first; None if the session is not visible."""
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        with self._unavailable():
            branch = await self._read_branch(tenant_id, session_id)
            if branch is None:
                return None
            await self._touch(session_id)
        return branch.messages

    async def list_sessions(
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
        index = self.keys.tenant_sessions(tenant_id)
        with self._unavailable():
            page = await read_page(
                self.redis,
                index,
                self.keys.session,
                lambda raw: self._owned(raw, tenant_id),
                after=after,
                limit=limit,
                max_bytes=max_bytes,
            )
            if page.expired:
                await self.redis.zrem(index, *page.expired)
        return page.summaries, page.next_cursor

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

    def _gave_up(self, session_id: str, action: str, conflict: rexc.WatchError) -> StoreError:
        # redis-py turns a connection lost while WATCHing into a WatchError
        # raised from the transport error; that is an outage, not contention.
        if is_transport_error(conflict.__context__):
            return StoreUnavailableError(
                f"lost the connection to redis during {action} of session {session_id!r}; "
                "nothing was written"
            )
        return StoreError(f"session {session_id!r} kept changing during {action}; try again")


def check_turn_id(turn_id: object) -> str:
    if not isinstance(turn_id, str) or not 0 < len(turn_id) <= MAX_TURN_ID_CHARS:
        raise ValueError(f"turn_id must be a non-empty str of at most {MAX_TURN_ID_CHARS} chars")
    return turn_id
