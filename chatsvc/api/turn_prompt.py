"""Building a turn's prompt from a branch of the session's tree.

A turn attaches below one message (its *parent*): the active branch's last
one by default, any earlier one to branch (an edit), or a user message whose
answer is regenerated. The prompt is the parent branch's stored token ids plus
the new messages' tokens, so a branch recomputes only what differs from its
parent (``ChatFormat.extend``; the prefix cache shares the rest):

    branch to the parent    sys u1 a1 u2      tokens: [ stored ............ ]
    new inputs                          u3    tokens:                      [ new ]
    regenerate an answer to u2              tokens: [ stored ............ ]  (nothing new)

Instructions (Responses API) are a system message rendered first and never
stored: a branch whose stored tokens began with other instructions, or none,
is rendered again from the start (``reused`` False), which is correct and costs
its reuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chatsvc.api import generation as gen
from chatsvc.api.errors import InvalidRequestError, NotFoundError
from chatsvc.service import Services
from chatsvc.store import InvalidInputError
from chatsvc.store.branch_read import Branch
from chatsvc.store.records import MessageRecord, SystemPromptRecord, TenantRecord
from chatsvc.store.tree import ROOT, branch_tokens, new_message_id

UNKNOWN_SESSION = "no such session"
UNKNOWN_MESSAGE = "no such message in this session"


@dataclass(frozen=True)
class TurnSpec:
    """What a turn adds and where.

    ``inputs``: (role, text) of the new messages, oldest first; none with
    ``regenerate``. ``parent_id``: the message they follow (None: the active
    branch's last; ``ROOT``: the top level). ``regenerate``: answer a user message
    again (``parent_id`` names it, or the active branch's last user message).
    ``store`` False writes nothing (no lock, no session made).
    """

    inputs: tuple[tuple[str, str], ...] = ()
    parent_id: str | None = None
    regenerate: bool = False
    instructions: str | None = None
    store: bool = True
    endpoint: str = "session_turn"


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
        branch = await services.store.get_branch(tenant.id, session_id, spec.parent_id)
    except InvalidInputError:  # a malformed id names no message
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


@dataclass
class Prompt:
    token_ids: list[int]
    reused: bool
    inputs: list[MessageRecord]  # the new messages, with ids, no tokens yet
    system: SystemPromptRecord | None


async def build_prompt(
    services: Services, tenant: TenantRecord, context: TurnContext, spec: TurnSpec
) -> Prompt:
    """The prompt for the turn: the context's tokens extended by the new messages."""
    conversation = []
    if spec.instructions is not None:
        conversation.append({"role": "system", "content": spec.instructions})
    conversation += [{"role": m.role, "content": m.text} for m in context.messages]
    conversation += [{"role": role, "content": text} for role, text in spec.inputs]
    prompt, reused = await gen.format_chat(
        services.engine.chat_format.extend, context.tokens, conversation
    )
    system = None
    if context.system_prompt_id is not None:
        system = await services.store.get_system_prompt(tenant.id, context.system_prompt_id)
    inputs = [
        MessageRecord(role=role, text=text, token_ids=[], id=new_message_id())
        for role, text in spec.inputs
    ]
    return Prompt(token_ids=prompt, reused=reused, inputs=inputs, system=system)


__all__ = [
    "ROOT",
    "UNKNOWN_MESSAGE",
    "UNKNOWN_SESSION",
    "Prompt",
    "TurnContext",
    "TurnSpec",
    "build_prompt",
    "read_context",
]
