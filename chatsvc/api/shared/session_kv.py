"""Deleting text deletes its KV too: KV can be inverted to text.

The engine finds the blocks from what the API knows: token histories, hashed
in the tenant's namespace (with the shared system prompt's blocks left public,
as when their turns ran). Blocks something else still uses stay: the longest
token prefix a history shares with another branch that is kept or with any
other of the tenant's sessions in the store (``keep_tokens``), and whatever
other sequences' blocks hang from (``cache.forget``).

    DELETE /sessions/{id}            every branch's history, and what the
                                     session computed below them (its owner tag)
    DELETE .../messages/{id},        the histories the write removed (the branches
    DELETE .../items/{id}            through the message, or the history rendered
                                     with the item), past what is left shares
"""

from __future__ import annotations

import logging

from chatsvc.api.shared.rendering import namespace_for, shared_prefix_len
from chatsvc.api.shared.store_access import get_session, locked_write
from chatsvc.protocol import EngineStoppedError
from chatsvc.service import Services
from chatsvc.store.errors import MalformedIdError
from chatsvc.store.records import SessionRecord, TenantRecord

log = logging.getLogger(__name__)


async def delete_session_and_kv(services: Services, tenant: TenantRecord, session_id: str) -> bool:
    """Delete the session from the store, then its KV; False when there is no such session.

    What the session shares with the tenant's other sessions is measured before
    anything is deleted, so a store error (503) leaves both the session and its
    KV in place for a retry.
    """
    session = await get_session(services, tenant, session_id)
    if session is None:
        return False
    histories = await services.store.tree.histories(tenant.id, session_id)
    histories = histories or [list(session.token_ids)]
    keep = await shared_with_other_sessions(services, tenant, session.id, histories)
    try:
        deleted = await services.store.sessions.delete(tenant.id, session_id)
    except MalformedIdError:
        deleted = False
    if deleted and services.engine_started:
        namespaces = await _namespaces(services, tenant, session, histories)
        try:
            for tokens, namespace, kept in zip(histories, namespaces, keep, strict=True):
                counts = await services.engine.forget_session(session.id, tokens, namespace, kept)
                log.info("session %s deleted: KV blocks removed per tier %s", session.id, counts)
        except EngineStoppedError:
            log.warning("session %s deleted with the engine stopped; its KV was not", session.id)
    return deleted


async def delete_with_kv(services: Services, tenant: TenantRecord, session_id: str, delete):
    """``locked_write`` of ``delete(lock, write_id)``, a write that removes messages;
    then the KV of the branch histories it removed goes too (below)."""
    store = services.store

    async def write(lock, write_id):
        before = await store.tree.histories(tenant.id, session_id)
        await delete(lock, write_id)
        return before, await store.tree.histories(tenant.id, session_id)

    before, after = await locked_write(services, tenant, session_id, write)
    session = await store.sessions.peek(tenant.id, session_id)
    if session is not None:
        await forget_removed_kv(services, tenant, session, before, after)


async def forget_removed_kv(
    services: Services,
    tenant: TenantRecord,
    session: SessionRecord,
    before: list[list[int]] | None,
    after: list[list[int]] | None,
) -> None:
    """After a write removed text from ``session``: delete the KV of every branch
    history in ``before`` that is no longer one of ``after``, past the longest prefix
    it shares with a history left (of this session or another of the tenant)."""
    if not before or not services.engine_started:
        return
    after = after or []
    gone = [tokens for tokens in before if tokens not in after]
    if not gone:
        return
    others = await shared_with_other_sessions(services, tenant, session.id, gone)
    namespaces = await _namespaces(services, tenant, session, gone)
    try:
        for tokens, namespace, other in zip(gone, namespaces, others, strict=True):
            keep = max([other, *(_common_prefix(tokens, left) for left in after)])
            counts = await services.engine.forget_tokens(tokens, namespace, keep)
            log.info("session %s: removed text's KV blocks per tier %s", session.id, counts)
    except EngineStoppedError:
        log.warning("session %s: text removed with the engine stopped; its KV was not", session.id)


async def _namespaces(services: Services, tenant: TenantRecord, session: SessionRecord, histories):
    system = None
    if session.system_prompt_id is not None:
        try:
            system = await services.store.prompts.get(tenant.id, session.system_prompt_id)
        except ValueError:
            system = None
    return [namespace_for(tenant, shared_prefix_len(t, system)) for t in histories]


async def shared_with_other_sessions(
    services, tenant, session_id: str, histories: list[list[int]]
) -> list[int]:
    """For each history, the longest token prefix it shares with another live session
    of the tenant (its active history).

    One pass over the tenant's sessions (listing gives summaries; each other's
    token history is read without refreshing its TTL); each comparison stops at
    the first token that differs (usually right after a common system prompt).
    """
    best = [0] * len(histories)
    cursor = None
    while any(b < len(h) for b, h in zip(best, histories, strict=True)):
        page, cursor = await services.store.sessions.list_page(tenant.id, limit=500, cursor=cursor)
        for summary in page:
            if summary.id == session_id or summary.num_tokens <= min(best):
                continue  # an empty or shorter history cannot share more than ``best``
            other = await services.store.sessions.peek(tenant.id, summary.id)
            if other is None:
                continue
            for i, tokens in enumerate(histories):
                best[i] = max(best[i], _common_prefix(tokens, other.token_ids))
        if cursor is None:
            break
    return best


def _common_prefix(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n
