"""Small builders shared by the store tests."""

from __future__ import annotations

import itertools

from chatsvc.store import Store
from chatsvc.store.lock import RedisLock
from chatsvc.store.records import MessageRecord, SessionRecord, TenantRecord, Usage

_names = itertools.count()


async def new_tenant(store: Store, name: str = "t") -> TenantRecord:
    """A tenant of its own: names are identities, so each call gets a fresh one."""
    return await store.tenants.ensure(f"{name}-{next(_names)}")


def turn(n: int) -> tuple[MessageRecord, MessageRecord]:
    """A user/assistant pair whose token ids encode ``n``, so order is checkable."""
    user = MessageRecord(role="user", text=f"question {n}", token_ids=[1000 + n, 1])
    assistant = MessageRecord(
        role="assistant",
        text=f"answer {n}",
        token_ids=[2000 + n, 2, 3],
        usage=Usage(prompt_tokens=10 + n, cached_tokens=n, completion_tokens=3, ttft_s=0.01),
    )
    return user, assistant


async def commit_after(
    store: Store,
    tenant_id: str,
    session_id: str,
    user: MessageRecord,
    assistant: MessageRecord,
    *,
    lock: RedisLock,
    turn_id: str | None = None,
    prompt_token_ids: list[int] | None = None,
) -> SessionRecord:
    """``user`` and ``assistant`` after the active branch, as the API commits a turn:
    the prompt is the session's history plus the user's ids unless given (a template
    that rendered the conversation again). The session afterwards, also when an
    earlier send under ``turn_id`` had already been applied."""
    session = await store.sessions.peek(tenant_id, session_id)
    parent = None if session is None else session.active_leaf
    history = [] if session is None else session.token_ids
    written = await store.branches.commit_turn(
        tenant_id,
        session_id,
        parent_id=parent,
        inputs=[user],
        output=assistant,
        prompt_token_ids=[*history, *user.token_ids]
        if prompt_token_ids is None
        else prompt_token_ids,
        lock=lock,
        turn_id=turn_id,
    )
    if written is None:
        return await store.sessions.peek(tenant_id, session_id)
    return written.session


async def append(store: Store, tenant_id: str, session_id: str, user, assistant, **kw):
    """One turn committed as the API commits it: under the session's turn lock."""
    async with store.sessions.turn_lock(tenant_id, session_id) as lock:
        return await commit_after(store, tenant_id, session_id, user, assistant, lock=lock, **kw)
