"""A turn's engine request: the branch's stored tokens extended by the new messages.

The prompt is the parent branch's stored token ids plus the new messages'
tokens, so a branch recomputes only what differs from its parent
(``ChatFormat.extend``; the prefix cache shares the rest):

    branch to the parent    sys u1 a1 u2      tokens: [ stored ............ ]
    new inputs                          u3    tokens:                      [ new ]
    regenerate an answer to u2              tokens: [ stored ............ ]  (nothing new)

Instructions (Responses API) are a system message rendered first and never
stored: a branch whose stored tokens began with other instructions, or none,
is rendered again from the start (``reused`` False), which is correct and costs
its reuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatsvc.api.shared.generation import new_request_id
from chatsvc.api.shared.rendering import format_chat, namespace_for, shared_prefix_len
from chatsvc.api.shared.sampling import fit_context
from chatsvc.api.turn.context import TurnContext
from chatsvc.api.turn.spec import TurnSpec
from chatsvc.protocol import GenerationRequest, SamplingParams
from chatsvc.service import Services
from chatsvc.store.records import MessageRecord, TenantRecord
from chatsvc.store.tree import link_chain, new_message_id


@dataclass
class PreparedTurn:
    session_id: str
    new_session: bool  # the commit creates the session (a first response)
    context: TurnContext
    inputs: list[MessageRecord]  # the new messages, ids assigned
    output_id: str  # the answer's id, known before it is generated
    request: GenerationRequest
    reused: bool  # the prompt extends the context's stored tokens
    spec: TurnSpec


async def prepare_turn(
    services: Services,
    tenant: TenantRecord,
    session_id: str,
    new_session: bool,
    context: TurnContext,
    spec: TurnSpec,
    sampling: SamplingParams,
    requested: int | None,
) -> PreparedTurn:
    """Render the prompt off the event loop and fit ``sampling`` to the room it leaves
    (400 when it cannot fit); tenant-salted, the shared system prompt's blocks public."""
    conversation = []
    if spec.instructions is not None:
        conversation.append({"role": "system", "content": spec.instructions})
    conversation += [{"role": m.role, "content": m.text} for m in context.messages]
    conversation += [{"role": role, "content": text} for role, text in spec.inputs]
    prompt, reused = await format_chat(
        services.engine.chat_format.extend, context.tokens, conversation
    )
    system = None
    if context.system_prompt_id is not None:
        system = await services.store.prompts.get(tenant.id, context.system_prompt_id)
    inputs = [
        MessageRecord(role=role, text=text, token_ids=[], id=new_message_id())
        for role, text in spec.inputs
    ]
    sampling = fit_context(services, len(prompt), sampling, requested)
    # "session" lets the engine tag the blocks this turn computes with their session,
    # so deleting the session finds them (it only tags: statistics ignore it).
    labels = {"tenant": tenant.id, "session": session_id}
    if context.system_prompt_id is not None:
        labels["system_prompt"] = context.system_prompt_id
    if not reused and context.tokens:
        services.usage.record_lost_reuse(labels)
    request = GenerationRequest(
        request_id=new_request_id("turn"),
        prompt_token_ids=prompt,
        sampling=sampling,
        namespace=namespace_for(tenant, shared_prefix_len(prompt, system)),
        labels=labels,
    )
    return PreparedTurn(
        session_id=session_id,
        new_session=new_session,
        context=context,
        inputs=link_chain(inputs, context.parent_id),
        output_id=new_message_id(),
        request=request,
        reused=reused,
        spec=spec,
    )
