"""Deleting a session deletes its KV too: KV can be inverted to text.

The engine finds the blocks from what the API knows: the session's token ids,
hashed in the tenant's namespace (with the shared system prompt's blocks left
public, as when its turns ran), and the session id the engine tagged its
turns' blocks with. Blocks another live session of the tenant still uses
stay: the longest token prefix this session shares with any other of the
tenant's sessions in the store is kept (``keep_tokens``), and the engine also
keeps whatever other sequences' blocks hang from (``cache.forget``).
"""

from __future__ import annotations

import logging

from chatsvc.api import generation as gen
from chatsvc.service import Services
from chatsvc.store import InvalidInputError
from chatsvc.store.records import SessionRecord, TenantRecord

log = logging.getLogger(__name__)


async def delete_session_and_kv(services: Services, tenant: TenantRecord, session_id: str) -> bool:
    """Delete the session from the store, then its KV; False when there is no such session.

    What the session shares with the tenant's other sessions is measured before
    anything is deleted, so a store error (503) leaves both the session and its
    KV in place for a retry.
    """
    from chatsvc.api.turn import get_session

    session = await get_session(services, tenant, session_id)
    if session is None:
        return False
    keep = await shared_with_other_sessions(services, tenant, session)
    try:
        deleted = await services.store.delete_session(tenant.id, session_id)
    except InvalidInputError:
        deleted = False
    if deleted:
        await forget_session_kv(services, tenant, session, keep)
    return deleted


async def forget_session_kv(
    services: Services, tenant: TenantRecord, session: SessionRecord, keep_tokens: int = 0
):
    """Remove the session's blocks from every tier; returns counts per tier (or None)."""
    from chatsvc.engine.errors import EngineStoppedError

    if not services.engine_started:
        return None
    system = None
    if session.system_prompt_id is not None:
        try:
            system = await services.store.get_system_prompt(tenant.id, session.system_prompt_id)
        except ValueError:
            system = None
    tokens = list(session.token_ids)
    namespace = gen.namespace_for(tenant, gen.shared_prefix_len(tokens, system))
    try:
        counts = await services.engine.forget_session(session.id, tokens, namespace, keep_tokens)
    except EngineStoppedError:
        log.warning("session %s deleted while the engine was stopped; its KV was not", session.id)
        return None
    log.info("session %s deleted: KV blocks removed per tier %s", session.id, counts)
    return counts


async def shared_with_other_sessions(services, tenant, session: SessionRecord) -> int:
    """The longest token prefix ``session`` shares with another live session of the tenant.

    One pass over the tenant's sessions (listing gives summaries; each other's
    token history is read without refreshing its TTL); each comparison stops at
    the first token that differs (usually right after a common system prompt).
    """
    tokens = session.token_ids
    best, cursor = 0, None
    while best < len(tokens):
        page, cursor = await services.store.list_sessions(tenant.id, limit=500, cursor=cursor)
        for summary in page:
            if summary.id == session.id or summary.num_tokens <= best:
                continue  # an empty or shorter history cannot share more than ``best``
            other = await services.store.peek_session(tenant.id, summary.id)
            if other is not None:
                best = max(best, _common_prefix(tokens, other.token_ids))
        if cursor is None:
            break
    return best


def _common_prefix(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n
