"""Small builders shared by the store tests."""

from __future__ import annotations

import itertools

from chatsvc.store import Store
from chatsvc.store.records import MessageRecord, TenantRecord, Usage

_names = itertools.count()


async def new_tenant(store: Store, name: str = "t") -> TenantRecord:
    """A tenant of its own: names are identities, so each call gets a fresh one."""
    return await store.ensure_tenant(f"{name}-{next(_names)}")


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


async def append(store: Store, tenant_id: str, session_id: str, user, assistant, **kwargs):
    """One turn committed as the API commits it: under the session's turn lock."""
    async with store.turn_lock(tenant_id, session_id) as lock:
        return await store.append_turn(tenant_id, session_id, user, assistant, lock=lock, **kwargs)
