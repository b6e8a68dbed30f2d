"""Deleting text deletes its KV too: KV can be inverted to text.

The engine finds the blocks from what the API knows: token histories, hashed
in the tenant's namespace (with the shared system prompt's blocks left public,
as when their turns ran). Blocks something else still uses stay: those of
another session (the cache keeps, per block, the sessions that used it), and
for text a session removed, the longest token prefix it shares with a branch
that is kept. Nothing here reads the tenant's other sessions: a delete costs
the deleted text's blocks, whatever the tenant's number of sessions.

    DELETE /sessions/{id},           every branch's history, and what the session
    DELETE /v1/conversations/{id}    computed below them (its owner tag)
    DELETE .../messages/{id},        the histories the write removed (the branches
    DELETE .../items/{id},           through the message, the history rendered with
    DELETE /v1/responses/{id}        the item, the response's turn), past what is left
                                     shares
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

    The histories are read before anything is deleted, so a store error (503)
    leaves both the session and its KV in place for a retry.
    """
    session = await get_session(services, tenant, session_id)
    if session is None:
        return False
    histories = await services.store.tree.histories(tenant.id, session_id)
    histories = histories or [list(session.token_ids)]
    try:
        deleted = await services.store.sessions.delete(tenant.id, session_id)
    except MalformedIdError:
        deleted = False
    if deleted:
        await _forget_session_kv(services, tenant, session, histories)
    return deleted


async def _forget_session_kv(
    services: Services, tenant: TenantRecord, session: SessionRecord, histories: list[list[int]]
) -> None:
    if not services.engine_started:
        return
    namespaces = await _namespaces(services, tenant, session, histories)
    try:
        for tokens, namespace in zip(histories, namespaces, strict=True):
            counts = await services.engine.forget_session(session.id, tokens, namespace)
            log.info("session %s deleted: KV blocks removed per tier %s", session.id, counts)
    except EngineStoppedError:
        log.warning("session %s deleted with the engine stopped; its KV was not", session.id)


async def delete_with_kv(services: Services, tenant: TenantRecord, session_id: str, delete):
    """``locked_write`` of ``delete(lock, write_id)``, a write that removes messages;
    then the KV of the branch histories it removed goes too (below). A write that
    took the session's last message with it (a response of a session made by
    responses) forgets the session's KV as ``DELETE /sessions/{id}`` does."""
    store = services.store

    async def write(lock, write_id):
        session = await store.sessions.peek(tenant.id, session_id)
        before = await store.tree.histories(tenant.id, session_id)
        await delete(lock, write_id)
        return session, before, await store.tree.histories(tenant.id, session_id)

    session, before, after = await locked_write(services, tenant, session_id, write)
    if session is None or not before:
        return
    if await store.sessions.peek(tenant.id, session_id) is None:
        await _forget_session_kv(services, tenant, session, before)
    else:
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
    it shares with a history left (another session's use the cache knows itself)."""
    if not before or not services.engine_started:
        return
    after = after or []
    gone = [tokens for tokens in before if tokens not in after]
    if not gone:
        return
    namespaces = await _namespaces(services, tenant, session, gone)
    try:
        for tokens, namespace in zip(gone, namespaces, strict=True):
            keep = max([0, *(_common_prefix(tokens, left) for left in after)])
            counts = await services.engine.forget_tokens(session.id, tokens, namespace, keep)
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


def _common_prefix(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n
