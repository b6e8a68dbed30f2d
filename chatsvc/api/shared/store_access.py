"""What the handlers of both APIs read from the store, and how they write a session.

Reads: a session, a branch of it, a page of its active branch, a system prompt.
Another tenant's record answers exactly like an unknown one (404), and so does
a malformed id, which can name nothing. Writes to a session run under its turn
lock (``locked_write``).
"""

from __future__ import annotations

import secrets

from chatsvc.api.shared.errors import InvalidRequestError, NotFoundError
from chatsvc.service import Services
from chatsvc.store.branch_read import Branch
from chatsvc.store.errors import InvalidInputError, MalformedIdError
from chatsvc.store.keys import check_id
from chatsvc.store.path_page import Order, PathPage
from chatsvc.store.records import SessionRecord, SystemPromptRecord, TenantRecord

UNKNOWN_SESSION = "no such session"
UNKNOWN_MESSAGE = "no such message in this session"
UNKNOWN_PROMPT = "no such system prompt"
# A page of messages or items ends early once its stored records pass this many
# bytes (at least one comes), so no page answer runs to megabytes.
PAGE_MAX_BYTES = 2**20


async def get_session(
    services: Services, tenant: TenantRecord, session_id: str
) -> SessionRecord | None:
    try:
        return await services.store.sessions.get(tenant.id, session_id)
    except MalformedIdError:  # a malformed id can name no session: same answer as an unknown one
        return None


async def read_branch(
    services: Services, tenant: TenantRecord, session_id: str, leaf_id: str | None = None
) -> Branch:
    """The branch ending at ``leaf_id`` (None: the active one); 404 when the session or
    the message is unknown (or another tenant's: the same answer)."""
    try:
        branch = await services.store.tree.branch(tenant.id, session_id, leaf_id)
    except MalformedIdError:  # a malformed id names nothing
        branch = None
    if branch is None:
        raise NotFoundError(UNKNOWN_SESSION if leaf_id is None else UNKNOWN_MESSAGE)
    return branch


async def read_page(
    services: Services,
    tenant: TenantRecord,
    session_id: str,
    *,
    limit: int,
    after: str | None,
    order: Order,
) -> PathPage:
    """A page of the active branch, read by position in the store (only the page), at
    most ``PAGE_MAX_BYTES`` of records; 404 for an unknown session, 400 for an
    ``after`` that is not on the branch."""
    try:
        check_id("session", session_id)
    except MalformedIdError:  # a malformed id names nothing
        raise NotFoundError(UNKNOWN_SESSION) from None
    try:
        page = await services.store.tree.page(
            tenant.id, session_id, limit=limit, after=after, order=order, max_bytes=PAGE_MAX_BYTES
        )
    except InvalidInputError as exc:
        raise InvalidRequestError(str(exc)) from None
    if page is None:
        raise NotFoundError(UNKNOWN_SESSION)
    return page


async def locked_write(services: Services, tenant: TenantRecord, session_id: str, write):
    """Run ``write(lock, write_id)`` under the session's turn lock: 404 for an unknown
    session or message, 409 while a turn runs. The write id is fresh per request; a
    resend of the same script after a lost reply carries it and is applied once.

    Only a malformed id is answered as unknown; any other bad input the write
    refuses (metadata, say) goes on to the error handlers as 400, and a cap it
    would pass as 429."""
    store = services.store
    try:
        async with store.sessions.turn_lock(tenant.id, session_id) as lock:
            return await write(lock, secrets.token_hex(16))
    except MalformedIdError:  # a malformed session or message id names nothing
        raise NotFoundError(UNKNOWN_SESSION) from None


async def visible_prompt(
    services: Services, tenant: TenantRecord, prompt_id: str
) -> SystemPromptRecord:
    """The tenant's own or a shared prompt by id; 404 for any other id, malformed ones too."""
    try:
        prompt = await services.store.prompts.get(tenant.id, prompt_id)
    except MalformedIdError:
        prompt = None
    if prompt is None:
        raise NotFoundError(UNKNOWN_PROMPT)
    return prompt
