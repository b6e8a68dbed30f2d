"""The branch a turn continues, and whether the session has room for the turn.

A turn attaches below one message (its *parent*): the active branch's last
one by default, any earlier one to branch (an edit), or a user message whose
answer is regenerated (the parent is then that user message, and the answer
being replaced is left out of the context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chatsvc.api.shared.errors import InvalidRequestError, NotFoundError, RateLimitError
from chatsvc.api.shared.store_access import UNKNOWN_MESSAGE, UNKNOWN_SESSION
from chatsvc.api.turn.spec import TurnSpec
from chatsvc.service import Services
from chatsvc.store.branch_read import Branch
from chatsvc.store.errors import MalformedIdError
from chatsvc.store.records import MessageRecord, TenantRecord
from chatsvc.store.tree import branch_tokens


@dataclass
class TurnContext:
    """The branch a turn continues, resolved under the turn's lock."""

    parent_id: str | None  # the message the new ones follow; None: the top level
    messages: list[MessageRecord] = field(default_factory=list)  # root first, parent last
    tokens: list[int] = field(default_factory=list)  # their token history
    system_prompt_id: str | None = None
    num_nodes: int = 0  # messages the session holds on all its branches


async def read_context(
    services: Services, tenant: TenantRecord, session_id: str, spec: TurnSpec
) -> TurnContext:
    """The branch the turn attaches to; 404 for an unknown session or message, 400
    when there is nothing to regenerate."""
    try:
        branch = await services.store.tree.branch(tenant.id, session_id, spec.parent_id)
    except MalformedIdError:  # a malformed id names no message
        raise NotFoundError(UNKNOWN_MESSAGE) from None
    if branch is None:
        raise NotFoundError(UNKNOWN_SESSION)
    if not spec.regenerate:
        return _context(branch, branch.messages, branch.tokens())
    messages = branch.messages
    if spec.parent_id is None and messages and messages[-1].role == "assistant":
        messages = messages[:-1]  # the answer being replaced
    if not messages or messages[-1].role != "user":
        raise InvalidRequestError(
            "regenerate answers a user message: name one with parent_message_id, or have "
            "the active branch end with a user message or its answer"
        )
    tokens = branch.tokens() if messages is branch.messages else branch_tokens(messages)
    return _context(branch, messages, tokens)


def _context(branch: Branch, messages: list[MessageRecord], tokens: list[int]) -> TurnContext:
    parent = messages[-1].id if messages else None
    return TurnContext(
        parent_id=parent,
        messages=list(messages),
        tokens=tokens,
        system_prompt_id=branch.session.system_prompt_id,
        num_nodes=branch.session.num_nodes,
    )


def check_room(services: Services, context: TurnContext, adding: int) -> None:
    """429 before generating when the session's messages would pass their cap."""
    limit = services.settings.limits.max_messages_per_session
    if context.num_nodes + adding > limit:
        raise RateLimitError(
            f"the session holds {context.num_nodes} messages; the limit is {limit}: "
            "delete some of its branches first"
        )


async def check_storage(services: Services, tenant_id: str, session_id: str | None) -> None:
    """429 before generating when the session (None: a new one) or its tenant already
    stores its byte quota: the commit would refuse the turn after the model ran."""
    limits = services.settings.limits
    store = services.store
    session_bytes, tenant_bytes = await store.sessions.storage(tenant_id, session_id)
    if session_bytes >= limits.max_session_bytes:
        raise RateLimitError(str(store.context.quota_error("session_quota")))
    if tenant_bytes >= limits.max_tenant_bytes:
        raise RateLimitError(str(store.context.quota_error("tenant_quota")))
