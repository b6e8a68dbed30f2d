"""Branching: turns from any message, switching the active branch, deleting branches and items.

Each message is stored once; a branch is a path through the tree (tree.py).
Every method here that writes is one ``TreeWriter.write`` call: fenced by the
turn lock, idempotent by its write id, atomic (writes.py, commit.py). Callers
hold the session's turn lock (``Sessions.turn_lock``), so these writes never
interleave with a running turn: a write while a turn runs is a 409 upstream.
"""

from __future__ import annotations

import msgspec

from chatsvc.store import validate as v
from chatsvc.store.branch_read import Branch
from chatsvc.store.commit import TreeWrite
from chatsvc.store.context import StoreContext
from chatsvc.store.errors import LimitExceededError, NotFoundError
from chatsvc.store.keys import check_id
from chatsvc.store.lock import RedisLock
from chatsvc.store.records import (
    MessageRecord,
    ResponseRecord,
    SessionRecord,
    decode,
    encode,
    encode_tokens,
)
from chatsvc.store.tree import (
    ROOT,
    branch_tokens,
    join_children,
    newest_continuation,
    split_prompt,
    subtree,
)
from chatsvc.store.tree_read import Tree
from chatsvc.store.writes import (
    Planned,
    TreeWriter,
    Written,
    next_summary,
    plan_active,
    plan_chain,
    plan_kept_path,
)


class Branches:
    """``store.branches``: the writes to a session's messages (each under its turn lock)."""

    def __init__(self, context: StoreContext, tree: Tree, writer: TreeWriter) -> None:
        self._ctx = context
        self._tree = tree
        self._writer = writer

    # -- turns -------------------------------------------------------------------

    async def commit_turn(
        self,
        tenant_id: str,
        session_id: str,
        *,
        parent_id: str | None,
        inputs: list[MessageRecord],
        output: MessageRecord,
        prompt_token_ids: list[int],
        lock: RedisLock,
        turn_id: str | None = None,
        response: ResponseRecord | None = None,
        max_nodes: int | None = None,
    ) -> Written | None:
        """Store one turn below ``parent_id`` (None: the top level) as a new branch, and
        make it the active one: the ``inputs`` (oldest first; none for a regenerated
        answer), then the ``output``, whose ``token_ids`` are the answer's.

        ``prompt_token_ids`` is the prompt the model saw. Where it extends the parent's
        token history, the last input (or, without inputs, the output) holds only the
        new ids, else the whole prompt (``from_start``); earlier inputs hold none (the
        last one's ids cover their text). Ids the records lack are assigned.
        ``response`` is stored with the turn. ``max_nodes`` caps the session's messages
        (``LimitExceededError``, nothing written). Fenced and idempotent as
        ``TreeWriter.write``; None when an earlier send of this turn was already applied.
        """
        for i, message in enumerate(inputs):
            v.check_message(f"inputs[{i}]", message, message.role)
            if message.role == "assistant" and i == len(inputs) - 1:
                raise ValueError("the last input of a turn must not be an assistant message")
        v.check_message("output", output, "assistant")
        prompt = v.check_token_ids("prompt_token_ids", prompt_token_ids)
        leaf = ROOT if parent_id is None else check_id("message", parent_id)

        def plan(branch: Branch) -> Planned:
            _check_room(branch, len(inputs) + 1, max_nodes)
            added, restart = split_prompt(branch.tokens(), prompt)
            records = [msgspec.structs.replace(m, token_ids=[], from_start=False) for m in inputs]
            answer = output
            if records:
                records[-1] = msgspec.structs.replace(
                    records[-1], token_ids=added, from_start=restart
                )
            else:
                answer = msgspec.structs.replace(
                    output, token_ids=[*added, *output.token_ids], from_start=restart
                )
            history = [*prompt, *output.token_ids]
            return plan_chain(
                branch, branch.leaf_id, [*records, answer], history, response=response
            )

        return await self._writer.write(
            tenant_id, session_id, plan, lock=lock, write_id=turn_id, leaf=leaf
        )

    async def add_messages(
        self,
        tenant_id: str,
        session_id: str,
        messages: list[MessageRecord],
        *,
        lock: RedisLock,
        write_id: str | None = None,
        max_nodes: int | None = None,
    ) -> Written | None:
        """Append ``messages`` to the active branch without running the model (a
        conversation's items): they hold no token ids, the next turn renders them."""
        records = []
        for i, message in enumerate(messages):
            v.check_message(f"messages[{i}]", message, message.role)
            records.append(msgspec.structs.replace(message, token_ids=[], from_start=False))

        def plan(branch: Branch) -> Planned:
            _check_room(branch, len(records), max_nodes)
            return plan_chain(branch, branch.leaf_id, records, None)

        return await self._writer.write(tenant_id, session_id, plan, lock=lock, write_id=write_id)

    # -- the active branch --------------------------------------------------------

    async def switch(
        self,
        tenant_id: str,
        session_id: str,
        message_id: str,
        *,
        lock: RedisLock,
        write_id: str | None = None,
    ) -> Written | None:
        """Make the branch through ``message_id`` active: from it, the newest child at
        every step down to a leaf. ``NotFoundError`` for an unknown message."""
        check_id("message", message_id)
        with self._ctx.unavailable():
            children = await self._tree.children(session_id)
        chain = newest_continuation(children, message_id)
        leaf = chain[-1] if chain else message_id

        def plan(branch: Branch) -> Planned:
            return plan_active(branch, branch)

        return await self._writer.write(
            tenant_id, session_id, plan, lock=lock, write_id=write_id, leaf=leaf
        )

    # -- deleting -----------------------------------------------------------------

    async def delete(
        self,
        tenant_id: str,
        session_id: str,
        message_id: str,
        *,
        lock: RedisLock,
        write_id: str | None = None,
    ) -> Written | None:
        """Remove ``message_id`` and every message below it (every branch through it);
        messages other branches use stay. Responses whose answer goes are removed too.
        If the active branch went, the parent's newest remaining continuation becomes
        active. ``NotFoundError`` for an unknown message."""
        check_id("message", message_id)

        async def plan(branch: Branch) -> Planned:
            top = await self._tree.node(session_id, message_id)
            children = await self._tree.children(session_id)
            responses = await self._tree.response_outputs(session_id)
            return await self.plan_removal(tenant_id, branch, top, children, responses)

        return await self._writer.write(tenant_id, session_id, plan, lock=lock, write_id=write_id)

    async def plan_removal(
        self,
        tenant_id: str,
        branch: Branch,
        top: MessageRecord,
        children: dict[str, list[str]],
        responses: dict[str, str],
        *,
        extra_response_dels: tuple[str, ...] = (),
    ) -> Planned:
        """The write that removes ``top``'s subtree (``branch``: the active one), and
        makes the parent's newest remaining continuation active if the active
        branch goes with it; ``responses``: each response -> its answer's id."""
        removed = subtree(children, top.id)
        gone = set(removed)
        parent_key = top.parent_id or ROOT
        siblings = [c for c in children.get(parent_key, []) if c != top.id]
        write = TreeWrite(summary=None, node_dels=removed)
        write.child_dels = [n for n in removed if n in children]
        if siblings:
            write.child_sets[parent_key] = join_children(siblings)
        else:
            write.child_dels.append(parent_key)
        write.response_dels = [rid for rid, out in responses.items() if out in gone]
        write.response_dels += [r for r in extra_response_dels if r not in write.response_dels]
        if branch.session.active_leaf not in gone:
            return plan_kept_path(branch, write)
        remaining = {**children, parent_key: siblings}
        chain = newest_continuation(remaining, parent_key)
        leaf = chain[-1] if chain else top.parent_id
        new = await self._tree.read_branch(tenant_id, branch.session.id, leaf or ROOT)
        if new is None:
            raise NotFoundError(f"unknown session {branch.session.id!r}")
        return plan_active(branch, new, write)

    async def delete_message(
        self,
        tenant_id: str,
        session_id: str,
        message_id: str,
        *,
        lock: RedisLock,
        write_id: str | None = None,
    ) -> Written | None:
        """Remove one message (a conversation's item) and keep what came after it: its
        children move up to its parent. The messages below it lose their token ids (they
        were rendered after the removed text), so the next turn renders them again. A
        response whose answer it was goes with it. ``NotFoundError`` if unknown."""
        check_id("message", message_id)

        async def plan(branch: Branch) -> Planned:
            top = await self._tree.node(session_id, message_id)
            children = await self._tree.children(session_id)
            responses = await self._tree.response_outputs(session_id)
            kids = children.get(message_id, [])
            parent_key = top.parent_id or ROOT
            below = subtree(children, message_id)[1:]
            # HMGET takes at least one field: the last message has nothing below it.
            nodes = self._ctx.keys.session_nodes(session_id)
            raws = await self._ctx.redis.hmget(nodes, below) if below else []
            write = TreeWrite(summary=None, node_dels=[message_id])
            for raw in raws:
                record = decode(MessageRecord, raw)
                parent = top.parent_id if record.id in kids else record.parent_id
                write.node_sets[record.id] = encode(
                    msgspec.structs.replace(
                        record, parent_id=parent, token_ids=[], from_start=False
                    )
                )
            # The children take the removed message's place among its siblings.
            siblings = []
            for child in children.get(parent_key, []):
                siblings.extend(kids if child == message_id else [child])
            if siblings:
                write.child_sets[parent_key] = join_children(siblings)
            else:
                write.child_dels.append(parent_key)
            if kids:
                write.child_dels.append(message_id)
            write.response_dels = [r for r, out in responses.items() if out == message_id]
            if message_id not in branch.ids:
                return plan_kept_path(branch, write)
            at = branch.ids.index(message_id)
            path = [
                *branch.messages[:at],
                *(decode(MessageRecord, write.node_sets[m.id]) for m in branch.messages[at + 1 :]),
            ]
            tokens = branch_tokens(path)
            summary = next_summary(
                branch.session,
                active_leaf=path[-1].id if path else None,
                num_messages=len(path),
                num_tokens=len(tokens),
                num_nodes=branch.session.num_nodes - 1,
            )
            write.summary = encode(summary)
            write.tokens = encode_tokens(tokens)
            write.path_keep = at
            write.path_tail = [m.id for m in path[at:]]
            return Planned(write, Written(session=SessionRecord.from_summary(summary, tokens)))

        return await self._writer.write(tenant_id, session_id, plan, lock=lock, write_id=write_id)

    # -- metadata -----------------------------------------------------------------

    async def update_metadata(
        self,
        tenant_id: str,
        session_id: str,
        metadata: dict[str, str] | None,
        *,
        lock: RedisLock,
        write_id: str | None = None,
    ) -> Written | None:
        """Replace the session's metadata."""
        meta = v.check_metadata(metadata)

        def plan(branch: Branch) -> Planned:
            return plan_kept_path(branch, TreeWrite(summary=None), metadata=meta)

        return await self._writer.write(tenant_id, session_id, plan, lock=lock, write_id=write_id)


def _check_room(branch: Branch, adding: int, max_nodes: int | None) -> None:
    if max_nodes is not None and branch.session.num_nodes + adding > max_nodes:
        raise LimitExceededError(
            f"the session holds {branch.session.num_nodes} messages; the limit is {max_nodes}"
        )
