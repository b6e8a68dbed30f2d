"""Every write to an existing session: one read, one plan, one fenced script.

``TreeWriter.write`` is the loop all of them share: read the branch the write
starts from, let the caller plan a ``TreeWrite`` from it, and apply that with
the checks of commit.py (already applied? session there? lock still ours?
nothing changed since the read?). A conflict means another writer got in
between; the loop reads and plans again. The plans the writes of branches.py
and responses.py have in common are the functions below: pure, no Redis.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from chatsvc.store import validate as v
from chatsvc.store.branch_read import Branch
from chatsvc.store.commit import SessionKeys, TreeWrite, fingerprint
from chatsvc.store.context import MAX_WATCH_RETRIES, StoreContext
from chatsvc.store.errors import NotFoundError, StoreError, TurnLockLostError
from chatsvc.store.keys import check_id
from chatsvc.store.lock import RedisLock
from chatsvc.store.records import (
    MessageRecord,
    ResponseRecord,
    SessionRecord,
    SessionSummary,
    encode,
    encode_tokens,
    now,
)
from chatsvc.store.sessions import forget_all_expired
from chatsvc.store.tree import ROOT, chain_children, link_chain
from chatsvc.store.tree_read import Tree

MAX_TURN_ID_CHARS = 128


@dataclass
class Written:
    """What a write left: the session afterwards and the messages it added."""

    session: SessionRecord
    messages: list[MessageRecord] = field(default_factory=list)


class Planned(NamedTuple):
    """A write, planned from one read, and what it will have written."""

    write: TreeWrite
    written: Written


def plan_chain(
    branch: Branch,
    parent_id: str | None,
    records: list[MessageRecord],
    history: list[int] | None,
    response: ResponseRecord | None = None,
) -> Planned:
    """The write that adds ``records`` as a chain below ``parent_id`` (the last
    message of ``branch``, or None for the top level) and makes its end the active
    branch. ``history``: the new branch's token history (None: unchanged)."""
    chain = link_chain(records, parent_id)
    for message in chain:
        v.check_message(f"message {message.id}", message, message.role)
        check_id("message", message.id)
    summary = next_summary(
        branch.session,
        active_leaf=chain[-1].id if chain else branch.leaf_id,
        num_messages=len(branch.messages) + len(chain),
        num_nodes=branch.session.num_nodes + len(chain),
        num_tokens=branch.session.num_tokens if history is None else len(history),
    )
    session = SessionRecord.from_summary(summary, branch.tokens() if history is None else history)
    write = TreeWrite(
        summary=encode(summary),
        tokens=None if history is None else encode_tokens(history),
        path_keep=branch.shared,
        path_tail=[*branch.ids[branch.shared :], *(m.id for m in chain)],
        node_sets={m.id: encode(m) for m in chain},
        child_sets=chain_children(
            chain, parent_key=parent_id or ROOT, existing=branch.continuations
        ),
    )
    if response is not None:
        write.response_sets[response.id] = encode(response)
    return Planned(write, Written(session=session, messages=chain))


def plan_active(branch: Branch, new: Branch, write: TreeWrite | None = None) -> Planned:
    """The write (``write``'s changes, if given) that makes ``new`` the active branch."""
    tokens = new.tokens()
    summary = next_summary(
        branch.session,
        active_leaf=new.leaf_id,
        num_messages=len(new.messages),
        num_tokens=len(tokens),
        num_nodes=branch.session.num_nodes - len(write.node_dels if write else ()),
    )
    write = write or TreeWrite(summary=None)
    write.summary = encode(summary)
    write.tokens = encode_tokens(tokens)
    write.path_keep = new.shared
    write.path_tail = new.ids[new.shared :]
    return Planned(write, Written(session=SessionRecord.from_summary(summary, tokens)))


def plan_kept_path(branch: Branch, write: TreeWrite, **changes) -> Planned:
    """``write`` (and summary ``changes``) with the active branch as it is: none of
    its messages is touched."""
    summary = next_summary(
        branch.session, num_nodes=branch.session.num_nodes - len(write.node_dels), **changes
    )
    write.summary = encode(summary)
    session = SessionRecord.from_summary(summary, branch.tokens())
    return Planned(write, Written(session=session))


def next_summary(summary: SessionSummary, **changes) -> SessionSummary:
    """``summary`` after one more write: ``changes``, a later ``updated_at``, version + 1."""
    # max(): a replica with a clock behind must not move updated_at backwards.
    return msgspec.structs.replace(
        summary,
        updated_at=max(now(), summary.updated_at),
        version=summary.version + 1,
        **changes,
    )


def check_turn_id(turn_id: object) -> str:
    if not isinstance(turn_id, str) or not 0 < len(turn_id) <= MAX_TURN_ID_CHARS:
        raise ValueError(f"turn_id must be a non-empty str of at most {MAX_TURN_ID_CHARS} chars")
    return turn_id


class TreeWriter:
    """The read -> plan -> apply loop every write to an existing session runs."""

    def __init__(self, context: StoreContext, tree: Tree) -> None:
        self._ctx = context
        self._tree = tree

    async def write(
        self,
        tenant_id: str,
        session_id: str,
        plan: Callable[[Branch], Planned | Awaitable[Planned]],
        *,
        lock: RedisLock,
        write_id: str | None,
        leaf: str | None = None,
    ) -> Written | None:
        """Read the branch ending at ``leaf`` (None: the active one), let ``plan`` turn it
        into a ``TreeWrite``, and apply that under the fence and idempotency checks of
        commit.py; on a conflict (another writer got in between) read and plan again.

        ``lock``: the session's turn lock as ``Sessions.turn_lock`` yielded it. ``write_id``
        names the write (default: fresh). Returns what ``plan`` promised, or None when
        an earlier send of this very write had already been applied. Raises
        ``NotFoundError`` (session not visible, or no message ``leaf``),
        ``TurnLockLostError`` and ``StorageQuotaError`` (nothing written), and whatever
        ``plan`` raises.
        """
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        keys = SessionKeys.of(self._ctx.keys, tenant_id, session_id)
        if not isinstance(lock, RedisLock) or lock.key != keys.lock:
            raise ValueError("a session write needs its turn lock, as turn_lock yields it")
        write_id = secrets.token_hex(16) if write_id is None else check_turn_id(write_id)
        pruned = False
        with self._ctx.unavailable():
            for _ in range(MAX_WATCH_RETRIES):
                branch = await self._tree.read_branch(tenant_id, session_id, leaf)
                if branch is None:
                    raise NotFoundError(f"unknown session {session_id!r}")
                planned = plan(branch)
                if inspect.isawaitable(planned):
                    planned = await planned
                outcome = await self._ctx.scripts.apply(
                    keys,
                    planned.write,
                    session_id=session_id,
                    write_id=write_id,
                    lock_token=lock.token,
                    read_fingerprint=fingerprint(branch.raw_summary),
                    score=planned.written.session.updated_at,
                    ttl_ms=self._ctx.ttl_ms(),
                )
                if outcome == "ok":
                    return planned.written
                if outcome == "applied":
                    return None
                if outcome == "not_found":
                    if planned.write.summary is None:
                        return None  # this write deletes the session: gone either way
                    raise NotFoundError(f"unknown session {session_id!r}")
                if outcome == "tenant_quota" and not pruned and self._ctx.session_ttl_s:
                    # Expired sessions may be what holds the tenant at its quota.
                    await forget_all_expired(self._ctx, tenant_id)
                    pruned = True
                    continue
                if outcome in ("session_quota", "tenant_quota"):
                    raise self._ctx.quota_error(outcome)
                if outcome == "lock_lost":
                    raise TurnLockLostError(
                        f"the turn lock of session {session_id!r} expired and may have been "
                        "taken by another turn; this write was not stored"
                    )
        raise StoreError(f"session {session_id!r} kept changing during a write; try again")
