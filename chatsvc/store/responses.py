"""Stored responses of the Responses API: records beside a session's message tree.

A response is one turn of a session (its input messages and its answer, stored
once in the tree); its record lives in the session's ``responses`` hash, so it
shares the session's slot, TTL, tenant and deletion. Its id names the session:

    resp_<session id>_<16 hex>

so a lookup needs no global index, and another tenant's response id finds a
session that is not theirs: the same None as an unknown id.
"""

from __future__ import annotations

import secrets

from chatsvc.store.branch_read import Branch
from chatsvc.store.branches import Branches
from chatsvc.store.commit import TreeWrite
from chatsvc.store.context import StoreContext
from chatsvc.store.errors import NotFoundError
from chatsvc.store.keys import check_id
from chatsvc.store.lock import RedisLock
from chatsvc.store.records import MessageRecord, ResponseRecord, SessionRecord, decode
from chatsvc.store.sessions import owned
from chatsvc.store.tree import subtree
from chatsvc.store.tree_read import Tree
from chatsvc.store.writes import Planned, TreeWriter, Written, plan_kept_path

RESPONSE_ID_PREFIX = "resp_"


def new_response_id(session_id: str) -> str:
    """A fresh id for a response stored in ``session_id``."""
    return f"{RESPONSE_ID_PREFIX}{session_id}_{secrets.token_hex(8)}"


def response_session(response_id: object) -> str | None:
    """The session a response id names, or None if it is not one of ours."""
    if not isinstance(response_id, str) or not response_id.startswith(RESPONSE_ID_PREFIX):
        return None
    head, sep, tail = response_id[len(RESPONSE_ID_PREFIX) :].rpartition("_")
    if not sep or not head or len(tail) != 16:
        return None
    try:
        check_id("response", response_id)
        return check_id("session", head)
    except ValueError:
        return None


class Responses:
    """``store.responses``: the Responses API's records, beside the messages of a session."""

    def __init__(
        self, context: StoreContext, tree: Tree, writer: TreeWriter, branches: Branches
    ) -> None:
        self._ctx = context
        self._tree = tree
        self._writer = writer
        self._branches = branches

    async def get(self, tenant_id: str, response_id: str) -> ResponseRecord | None:
        """The response, or None if unknown, deleted, expired or another tenant's."""
        check_id("tenant", tenant_id)
        session_id = response_session(response_id)
        if session_id is None:
            return None
        keys = self._ctx.keys
        with self._ctx.unavailable():
            async with self._ctx.redis.pipeline(transaction=True) as pipe:
                pipe.get(keys.session(session_id))
                pipe.hget(keys.session_responses(session_id), response_id)
                raw, raw_response = await pipe.execute()
            if owned(raw, tenant_id) is None or raw_response is None:
                return None
            await self._ctx.touch(session_id)
        return decode(ResponseRecord, raw_response)

    async def delete(
        self,
        tenant_id: str,
        response_id: str,
        *,
        lock: RedisLock,
        write_id: str | None = None,
    ) -> Written | None:
        """Remove a response (``lock``: its session's turn lock).

        A response of a conversation leaves its messages there (they are the
        conversation's items). Otherwise its messages go too, as far as no other
        branch uses them (a later response chained on it, an answer regenerated from
        its input), and a session made by responses goes whole once its last response
        and message have. ``NotFoundError`` if the response is not visible.
        """
        session_id = response_session(response_id)
        if session_id is None:
            raise NotFoundError(f"unknown response {response_id!r}")

        async def plan(branch: Branch) -> Planned:
            raw = await self._ctx.redis.hget(self._ctx.keys.session_responses(session_id), rid)
            if raw is None:
                raise NotFoundError(f"unknown response {rid!r}")
            record = decode(ResponseRecord, raw)
            only_record = TreeWrite(summary=None, response_dels=[rid])
            if record.conversation_id is not None:
                return plan_kept_path(branch, only_record)
            children = await self._tree.children(session_id)
            outputs = await self._tree.response_outputs(session_id)
            kept_outputs = {out for r, out in outputs.items() if r != rid}
            top = await self._prunable_top(session_id, record, children, kept_outputs)
            if top is None:
                return plan_kept_path(branch, only_record)
            if not kept_outputs and branch.session.kind == "response":
                if len(subtree(children, top.id)) == branch.session.num_nodes:
                    # Nothing is left that anyone made: the session goes whole.
                    session = SessionRecord.from_summary(branch.session, [])
                    return Planned(TreeWrite(summary=None), Written(session=session))
            return await self._branches.plan_removal(
                tenant_id, branch, top, children, outputs, extra_response_dels=(rid,)
            )

        rid = response_id
        return await self._writer.write(tenant_id, session_id, plan, lock=lock, write_id=write_id)

    async def _prunable_top(
        self,
        session_id: str,
        record: ResponseRecord,
        children: dict[str, list[str]],
        kept_outputs: set[str],
    ) -> MessageRecord | None:
        """The highest message whose subtree only the response being deleted uses: the
        earliest of its own messages with nothing of others below, then up through
        parents that had it as their only child and answer no remaining response (the
        messages of responses deleted before, which it alone still carried)."""
        ours = [*record.input_ids, record.output_id]
        top_id = next((m for m in ours if set(subtree(children, m)) <= set(ours)), None)
        if top_id is None:
            return None
        try:
            top = await self._tree.node(session_id, top_id)
        except NotFoundError:
            return None  # its messages were deleted as conversation items
        while top.parent_id is not None:
            parent_id = top.parent_id
            if children.get(parent_id) != [top.id] or parent_id in kept_outputs:
                break
            top = await self._tree.node(session_id, parent_id)
        return top
