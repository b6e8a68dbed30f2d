"""Reading a session's message tree: branches, messages by id, every branch's history.

A branch comes from one script (``branch_read.py``), read at one instant; the
other reads are one MULTI each, for the same reason. The writes that plan from
these reads (writes.py, branches.py, responses.py) take ``Tree`` as an argument.
"""

from __future__ import annotations

from chatsvc.store.branch_read import Branch, UnknownMessage
from chatsvc.store.context import StoreContext
from chatsvc.store.errors import InvalidInputError, NotFoundError
from chatsvc.store.keys import check_id
from chatsvc.store.path_page import MAX_PAGE_LIMIT, Order, PathPage
from chatsvc.store.records import MessageRecord, ResponseRecord, decode, decode_tokens
from chatsvc.store.sessions import owned
from chatsvc.store.tree import branch_tokens, leaf_paths, split_children


class Tree:
    """``store.tree``: reads of sessions' messages; see tree.py for the shape."""

    def __init__(self, context: StoreContext) -> None:
        self._ctx = context

    async def branch(
        self, tenant_id: str, session_id: str, leaf_id: str | None = None
    ) -> Branch | None:
        """The branch ending at ``leaf_id`` (None: the active one), read at one instant;
        None if the session is not visible; ``NotFoundError`` if it holds no such
        message. Refreshes the session's TTL."""
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        if leaf_id is not None:
            check_id("message", leaf_id)
        with self._ctx.unavailable():
            branch = await self.read_branch(tenant_id, session_id, leaf_id)
            if branch is not None:
                await self._ctx.touch(session_id)
        return branch

    async def messages(self, tenant_id: str, session_id: str) -> list[MessageRecord] | None:
        """The messages of the active branch, oldest first; None if the session is not visible.
        Refreshes the session's TTL."""
        branch = await self.branch(tenant_id, session_id)
        return None if branch is None else branch.messages

    async def page(
        self,
        tenant_id: str,
        session_id: str,
        *,
        limit: int,
        after: str | None = None,
        order: Order = "asc",
        max_bytes: int | None = None,
    ) -> PathPage | None:
        """Up to ``limit`` messages of the active branch next to the message ``after``
        (None: from its start, ``order`` "asc", or its end, "desc"), fewer where their
        records would pass ``max_bytes`` (at least one): only the page is read
        (path_page.py). None if the session is not visible; ``InvalidInputError`` if
        ``after`` is not on the active branch. Refreshes the session's TTL."""
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        if after is not None:
            check_id("message", after)
        if not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE_LIMIT:
            raise InvalidInputError(f"limit must be an int in [1, {MAX_PAGE_LIMIT}], got {limit!r}")
        if order not in ("asc", "desc"):
            raise InvalidInputError(f"order must be 'asc' or 'desc', got {order!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise InvalidInputError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        k = self._ctx.keys
        keys = (
            k.session(session_id),
            k.session_path(session_id),
            k.session_nodes(session_id),
            k.session_children(session_id),
        )
        with self._ctx.unavailable():
            page = await self._ctx.pager.read(
                keys, tenant_id, limit=limit, after=after, order=order, max_bytes=max_bytes
            )
            if page is not None:
                await self._ctx.touch(session_id)
        return page

    async def messages_by_id(
        self, tenant_id: str, session_id: str, message_ids: list[str]
    ) -> list[MessageRecord | None] | None:
        """The session's messages of those ids (None where it holds none), in that
        order; None if the session is not visible."""
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        for message_id in message_ids:
            check_id("message", message_id)
        keys = self._ctx.keys
        with self._ctx.unavailable():
            async with self._ctx.redis.pipeline(transaction=True) as pipe:
                pipe.get(keys.session(session_id))
                if message_ids:
                    pipe.hmget(keys.session_nodes(session_id), message_ids)
                raw, *found = await pipe.execute()
            if owned(raw, tenant_id) is None:
                return None
        raws = found[0] if found else []
        return [None if r is None else decode(MessageRecord, r) for r in raws]

    async def histories(self, tenant_id: str, session_id: str) -> list[list[int]] | None:
        """The token history of every branch, the active one first (its stored history),
        read at one instant; None if the session is not visible. Leaves the TTL alone:
        deleting reads it to find the KV to delete."""
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        keys = self._ctx.keys
        with self._ctx.unavailable():
            async with self._ctx.redis.pipeline(transaction=True) as pipe:
                pipe.get(keys.session(session_id))
                pipe.get(keys.session_tokens(session_id))
                pipe.hgetall(keys.session_nodes(session_id))
                pipe.hgetall(keys.session_children(session_id))
                raw, raw_tokens, raw_nodes, raw_children = await pipe.execute()
        if owned(raw, tenant_id) is None:
            return None
        nodes = {k.decode(): decode(MessageRecord, v) for k, v in raw_nodes.items()}
        children = {k.decode(): split_children(v) for k, v in raw_children.items()}
        histories = [decode_tokens(raw_tokens) if raw_tokens else []]
        for path in leaf_paths(nodes, children):
            tokens = branch_tokens(path)
            if tokens not in histories:
                histories.append(tokens)
        return histories

    # -- the reads writes plan from (ids already checked, inside ``unavailable``) --

    async def read_branch(
        self, tenant_id: str, session_id: str, leaf: str | None = None
    ) -> Branch | None:
        """The branch ending at ``leaf`` (None: the active one; ``ROOT``: no message),
        TTL untouched; None if the session is not visible; ``NotFoundError`` if it
        holds no such message."""
        k = self._ctx.keys
        keys = (
            k.session(session_id),
            k.session_path(session_id),
            k.session_nodes(session_id),
            k.session_children(session_id),
            k.session_tokens(session_id),
        )
        try:
            return await self._ctx.reader.read(keys, tenant_id, leaf)
        except UnknownMessage:
            raise NotFoundError(f"unknown message {leaf!r}") from None

    async def children(self, session_id: str) -> dict[str, list[str]]:
        """Every child list of the session: message id (or ``ROOT``) -> child ids."""
        raw = await self._ctx.redis.hgetall(self._ctx.keys.session_children(session_id))
        return {k.decode(): split_children(value) for k, value in raw.items()}

    async def node(self, session_id: str, message_id: str) -> MessageRecord:
        """One message of the session; ``NotFoundError`` if it holds none of that id."""
        raw = await self._ctx.redis.hget(self._ctx.keys.session_nodes(session_id), message_id)
        if raw is None:
            raise NotFoundError(f"unknown message {message_id!r}")
        return decode(MessageRecord, raw)

    async def response_outputs(self, session_id: str) -> dict[str, str]:
        """Each stored response of the session -> the id of its answer message."""
        raw = await self._ctx.redis.hgetall(self._ctx.keys.session_responses(session_id))
        return {k.decode(): decode(ResponseRecord, r).output_id for k, r in raw.items()}
