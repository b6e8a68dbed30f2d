"""Every write to an existing session: one read, one plan, one fenced script.

``write_tree`` is the loop all of them share: read the branch the write starts
from, let the caller plan a ``TreeWrite`` from it, and apply that with the
checks of commit.py (already applied? session there? lock still ours? nothing
changed since the read?). A conflict means another writer got in between; the
loop reads and plans again. ``append_turn`` is the simplest such write.
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
from chatsvc.store.commit import TreeWrite, fingerprint
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
from chatsvc.store.sessions import MAX_WATCH_RETRIES, SessionStore, check_turn_id
from chatsvc.store.tree import ROOT, chain_children, link_chain


@dataclass
class Written:
    """What a write left: the session afterwards and the messages it added."""

    session: SessionRecord
    messages: list[MessageRecord] = field(default_factory=list)


class Planned(NamedTuple):
    """A write, planned from one read, and what it will have written."""

    write: TreeWrite
    written: Written


class TreeStore(SessionStore):
    """Writes to existing sessions; see ``Store.connect`` to build one."""

    async def append_turn(
        self,
        tenant_id: str,
        session_id: str,
        user: MessageRecord,
        assistant: MessageRecord,
        *,
        lock: RedisLock,
        turn_id: str | None = None,
        token_ids: list[int] | None = None,
    ) -> SessionRecord:
        """Append a user and an assistant message to the active branch in one atomic,
        fenced, idempotent write.

        ``lock`` is the session's turn lock as ``turn_lock`` yielded it: the
        write happens only while its token still holds the lock key, checked in
        the same atomic step, so a turn whose lock expired and was taken by
        another turn can never interleave with it (``TurnLockLostError``,
        nothing written). ``turn_id`` names the turn (default: a fresh id per
        call); a turn already applied under that id is not applied again, which
        makes a resend after a lost reply harmless.

        The session's ``token_ids`` become ``token_ids`` when given (the full
        conversation as the model last saw it, e.g. after a template re-render:
        the user message then holds the history from the start), else the old
        ones plus the user's and the assistant's token ids. ``updated_at``,
        ``num_messages``, the index score and the TTL move with them. Returns the
        updated session; raises ``NotFoundError`` if the session is not visible
        (deleted, expired, another tenant's).
        """
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        v.check_message("user", user, "user")
        v.check_message("assistant", assistant, "assistant")
        if token_ids is not None:
            token_ids = v.check_token_ids("token_ids", token_ids)

        def plan(branch: Branch) -> Planned:
            base = branch.tokens()
            extended = [*base, *user.token_ids, *assistant.token_ids]
            history = extended if token_ids is None else token_ids
            restart = token_ids is not None and token_ids != extended
            first = msgspec.structs.replace(user, from_start=restart)
            return self._plan_chain(branch, branch.leaf_id, [first, assistant], history)

        written = await self.write_tree(
            tenant_id, session_id, plan, lock=lock, write_id=turn_id, leaf=None
        )
        if written is None:
            # Applied by an earlier send; what it wrote is what is stored now.
            written = await self._read_session(tenant_id, session_id)
            if written is None:
                raise NotFoundError(f"unknown session {session_id!r}")
            return written
        return written.session

    def _plan_chain(
        self,
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
        summary = self.next_summary(
            branch.session,
            active_leaf=chain[-1].id if chain else branch.leaf_id,
            num_messages=len(branch.messages) + len(chain),
            num_nodes=branch.session.num_nodes + len(chain),
            num_tokens=branch.session.num_tokens if history is None else len(history),
        )
        session = SessionRecord.from_summary(
            summary, branch.tokens() if history is None else history
        )
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

    @staticmethod
    def next_summary(summary: SessionSummary, **changes) -> SessionSummary:
        """``summary`` after one more write: ``changes``, a later ``updated_at``, version + 1."""
        # max(): a replica with a clock behind must not move updated_at backwards.
        return msgspec.structs.replace(
            summary,
            updated_at=max(now(), summary.updated_at),
            version=summary.version + 1,
            **changes,
        )

    async def write_tree(
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

        ``lock``: the session's turn lock as ``turn_lock`` yielded it. ``write_id``
        names the write (default: fresh). Returns what ``plan`` promised, or None when
        an earlier send of this very write had already been applied. Raises
        ``NotFoundError`` (session not visible, or no message ``leaf``),
        ``TurnLockLostError`` (nothing written), and whatever ``plan`` raises.
        """
        check_id("tenant", tenant_id)
        check_id("session", session_id)
        keys = self._session_keys(tenant_id, session_id)
        if not isinstance(lock, RedisLock) or lock.key != keys.lock:
            raise ValueError("a session write needs its turn lock, as turn_lock yields it")
        write_id = secrets.token_hex(16) if write_id is None else check_turn_id(write_id)
        with self._unavailable():
            for _ in range(MAX_WATCH_RETRIES):
                branch = await self._read_branch(tenant_id, session_id, leaf)
                if branch is None:
                    raise NotFoundError(f"unknown session {session_id!r}")
                planned = plan(branch)
                if inspect.isawaitable(planned):
                    planned = await planned
                outcome = await self._scripts.apply(
                    keys,
                    planned.write,
                    session_id=session_id,
                    write_id=write_id,
                    lock_token=lock.token,
                    read_fingerprint=fingerprint(branch.raw_summary),
                    score=planned.written.session.updated_at,
                    ttl_ms=self._ttl_ms(),
                )
                if outcome == "ok":
                    return planned.written
                if outcome == "applied":
                    return None
                if outcome == "not_found":
                    if planned.write.summary is None:
                        return None  # this write deletes the session: gone either way
                    raise NotFoundError(f"unknown session {session_id!r}")
                if outcome == "lock_lost":
                    raise TurnLockLostError(
                        f"the turn lock of session {session_id!r} expired and may have been "
                        "taken by another turn; this write was not stored"
                    )
        raise StoreError(f"session {session_id!r} kept changing during a write; try again")
