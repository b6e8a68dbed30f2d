"""One turn of a session: new messages in, assistant message out, stored once.

Life of a turn (the order is what keeps Redis consistent):

    validate body            -> 400, nothing touched
    load session             -> 404
    take the turn lock       -> 409 (another turn of this session is running)
    take a generation slot   -> 429
    read the branch it continues, build the prompt, fit the context -> 400, lock released
    generate (streamed or not)
    on finish: commit (the new messages, the answer, the token history and the
               active branch in one atomic write, only while this turn still
               holds the lock) -> 409 if it lost it
    release lock and slot

A turn that does not finish (client gone, engine abort, error) is not
acknowledged: nothing is stored and the history stays as it was, so a
retried message never sees a half answer in its context.

Two kinds of turn hold no lock: one that stores nothing (``store`` False: the
Responses API's ``store: false``), and the first turn of a session made by the
Responses API, which creates the session with its messages in one write (no
one else knows the session's id before that write).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import msgspec

from chatsvc import affinity
from chatsvc.api import generation as gen
from chatsvc.api.errors import ConflictError, NotFoundError, RateLimitError, ServiceUnavailableError
from chatsvc.api.turn_prompt import (
    UNKNOWN_SESSION,
    TurnContext,
    TurnSpec,
    build_prompt,
    read_context,
)
from chatsvc.logs import text_for_log
from chatsvc.protocol import GenerationRequest, SamplingParams
from chatsvc.service import Services
from chatsvc.store import InvalidInputError, TurnLockLostError
from chatsvc.store.errors import LimitExceededError
from chatsvc.store.lock import RedisLock
from chatsvc.store.records import MessageRecord, ResponseRecord, TenantRecord
from chatsvc.store.records import Usage as UsageRecord
from chatsvc.store.tree import link_chain, new_message_id

log = logging.getLogger(__name__)

__all__ = ["UNKNOWN_SESSION", "PreparedTurn", "StoredTurn", "TurnSpec", "begin_turn", "run_turn"]


@dataclass
class PreparedTurn:
    session_id: str
    new_session: bool  # the commit creates the session (a first response)
    context: TurnContext
    inputs: list[MessageRecord]  # the new messages, ids assigned
    output_id: str  # the answer's id, known before it is generated
    request: GenerationRequest
    reused: bool
    spec: TurnSpec


@dataclass
class StoredTurn:
    """A finished turn: what the model produced and, when stored, what was stored."""

    session_id: str
    inputs: list[MessageRecord]
    output: MessageRecord
    sample: gen.SampleResult
    reused: bool
    stored: bool


class TurnHold:
    """The turn lock (if any) and the generation slot of one turn; ``release`` is idempotent.

    ``lock`` is what the turn's commit is fenced by (see ``Store.commit_turn``).
    """

    def __init__(self, slot: gen.StreamSlot, lock_cm=None, lock: RedisLock | None = None) -> None:
        self._slot = slot
        self._lock_cm = lock_cm
        self.lock = lock
        self._released = False

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            if self._lock_cm is not None:
                # Shielded: on a client disconnect this runs inside a cancelled scope,
                # and an unshielded await would leave the lock held until its TTL.
                with anyio.CancelScope(shield=True):
                    await self._lock_cm.__aexit__(None, None, None)
        finally:
            self._slot.release()


async def begin_turn(
    services: Services,
    tenant: TenantRecord,
    session_id: str | None,
    spec: TurnSpec,
    sampling,
    requested: int | None,
) -> tuple[PreparedTurn, TurnHold]:
    """Lock, read the branch and build the prompt; on any failure nothing stays held
    or written. ``session_id`` None: a session this turn makes (stored turns only)."""
    store = services.store
    if session_id is None:
        return await _begin_new_session(services, tenant, spec, sampling, requested)
    if await get_session(services, tenant, session_id) is None:
        raise NotFoundError(UNKNOWN_SESSION)
    lock_cm = lock = None
    if spec.store:
        # The lock comes before the slot: clients racing on one session get 409 and
        # never hold one of the tenant's generation slots while they lose the race.
        lock_cm = store.turn_lock(tenant.id, session_id)
        lock = await lock_cm.__aenter__()
    try:
        slot = gen.StreamSlot(services, tenant.id)
    except BaseException:
        if lock_cm is not None:
            with anyio.CancelScope(shield=True):
                await lock_cm.__aexit__(None, None, None)
        raise
    hold = TurnHold(slot, lock_cm, lock)
    try:
        # Read under the lock: the turn before this one may have finished since.
        context = await read_context(services, tenant, session_id, spec)
        prepared = await _prepare(
            services, tenant, session_id, False, context, spec, sampling, requested
        )
    except BaseException:
        await hold.release()
        raise
    return prepared, hold


async def _begin_new_session(services, tenant, spec, sampling, requested):
    if spec.store:
        limit = services.settings.limits.max_sessions_per_tenant
        if await services.store.count_sessions(tenant.id) >= limit:
            raise RateLimitError(f"this tenant already has {limit} sessions; delete some first")
    hold = TurnHold(gen.StreamSlot(services, tenant.id))
    try:
        session_id = secrets.token_hex(16)
        prepared = await _prepare(
            services, tenant, session_id, True, TurnContext(None), spec, sampling, requested
        )
    except BaseException:
        await hold.release()
        raise
    return prepared, hold


async def get_session(services: Services, tenant: TenantRecord, session_id: str):
    try:
        return await services.store.get_session(tenant.id, session_id)
    except InvalidInputError:  # a malformed id can name no session: same answer as an unknown one
        return None


async def _prepare(
    services: Services,
    tenant: TenantRecord,
    session_id: str,
    new_session: bool,
    context: TurnContext,
    spec: TurnSpec,
    sampling: SamplingParams,
    requested: int | None,
) -> PreparedTurn:
    check_room(services, context, len(spec.inputs) + 1)
    prompt = await build_prompt(services, tenant, context, spec)
    sampling = gen.fit_context(services, len(prompt.token_ids), sampling, requested)
    # "session" lets the engine tag the blocks this turn computes with their session,
    # so deleting the session finds them (it only tags: statistics ignore it).
    labels = {"tenant": tenant.id, "session": session_id}
    if context.system_prompt_id is not None:
        labels["system_prompt"] = context.system_prompt_id
    if not prompt.reused and context.tokens:
        services.usage.record_lost_reuse(labels)
    request = GenerationRequest(
        request_id=gen.new_request_id("turn"),
        prompt_token_ids=prompt.token_ids,
        sampling=sampling,
        namespace=gen.namespace_for(tenant, gen.shared_prefix_len(prompt.token_ids, prompt.system)),
        labels=labels,
    )
    return PreparedTurn(
        session_id=session_id,
        new_session=new_session,
        context=context,
        inputs=link_chain(prompt.inputs, context.parent_id),
        output_id=new_message_id(),
        request=request,
        reused=prompt.reused,
        spec=spec,
    )


ResponseFactory = Callable[[PreparedTurn, MessageRecord, gen.SampleResult], ResponseRecord]


async def run_turn(
    services: Services,
    tenant: TenantRecord,
    turn: PreparedTurn,
    hold: TurnHold,
    response: ResponseFactory | None = None,
) -> AsyncIterator[str | StoredTurn]:
    """Yield text pieces, then the StoredTurn once the turn is stored; releases ``hold``.

    ``response`` builds the Responses API record stored with the turn.
    """
    sample = gen.SampleResult()
    try:
        async for delta in gen.generate(services, turn.request):
            sample.add(delta)
            if delta.text:
                yield delta.text
        if not sample.finished:
            services.metrics.observe_failure(turn.spec.endpoint, "aborted")
            raise ServiceUnavailableError("the generation was aborted; the turn was not stored")
        output = await _answer(services, turn, sample)
        if turn.spec.store:
            record = None if response is None else response(turn, output, sample)
            await _store(services, tenant, turn, output, record, hold.lock)
        m = sample.metrics
        log.info(
            "turn %s: session %s, engine request %s, %d prompt tokens (%d cached), "
            "%d completion tokens",
            "stored" if turn.spec.store else "not stored (store: false)",
            turn.session_id,
            turn.request.request_id,
            m.prompt_tokens,
            m.cached_prompt_tokens,
            m.completion_tokens,
        )
        log.debug(
            "turn text: inputs %s, assistant %s",
            [text_for_log(i.text) for i in turn.inputs],
            text_for_log(sample.text),
        )
        gen.record_finished(services, turn.spec.endpoint, turn.request.labels, [sample])
        if turn.spec.store:
            affinity.record_turn(services, turn, m, len(sample.token_ids))
        yield StoredTurn(
            session_id=turn.session_id,
            inputs=turn.inputs,
            output=output,
            sample=sample,
            reused=turn.reused,
            stored=turn.spec.store,
        )
    finally:
        await hold.release()


async def _answer(services, turn: PreparedTurn, sample) -> MessageRecord:
    m = sample.metrics
    # Text and tokens stored must agree (a stop string cuts the text, not the tokens),
    # or the next turn's render no longer extends the stored tokens.
    answer_ids = await gen.format_chat(
        services.engine.chat_format.answer_token_ids,
        turn.request.prompt_token_ids,
        sample.token_ids,
        sample.text,
    )
    return MessageRecord(
        role="assistant",
        text=sample.text,
        token_ids=answer_ids,
        usage=UsageRecord(
            prompt_tokens=m.prompt_tokens,
            cached_tokens=m.cached_prompt_tokens,
            completion_tokens=m.completion_tokens,
            ttft_s=m.ttft_s,
        ),
        id=turn.output_id,
        parent_id=turn.inputs[-1].id if turn.inputs else turn.context.parent_id,
    )


async def _store(services, tenant, turn, output, record, lock: RedisLock | None) -> None:
    store = services.store
    # Shielded so a disconnect arriving during the write cannot cut its round trip in
    # half; the write itself is all-or-nothing in Redis either way. The request id
    # names the turn: a commit resent after a lost reply is then recognised as
    # already applied instead of storing the turn twice.
    try:
        with anyio.CancelScope(shield=True):
            if turn.new_session:
                # A new session's history starts with this prompt, carried by the last
                # input (the earlier ones are rendered in it).
                inputs = list(turn.inputs)
                inputs[-1] = msgspec.structs.replace(
                    inputs[-1], token_ids=list(turn.request.prompt_token_ids)
                )
                await store.create_session(
                    tenant.id,
                    None,
                    None,
                    None,
                    None if record is None else record.metadata,
                    messages=[*inputs, output],
                    kind="response",
                    response=record,
                    session_id=turn.session_id,
                )
            else:
                await store.commit_turn(
                    tenant.id,
                    turn.session_id,
                    parent_id=turn.context.parent_id,
                    inputs=turn.inputs,
                    output=output,
                    prompt_token_ids=turn.request.prompt_token_ids,
                    lock=lock,
                    turn_id=turn.request.request_id,
                    response=record,
                    max_nodes=services.settings.limits.max_messages_per_session,
                )
    except TurnLockLostError:
        services.metrics.observe_failure(turn.spec.endpoint, "lock_lost")
        raise ConflictError(
            "the session's turn lock expired while this turn ran (a stall or a Redis "
            "failover longer than its TTL) and another turn may have taken over; "
            "this turn was not stored, send the message again",
            error_type="turn_lock_lost",
        ) from None
    except LimitExceededError as exc:
        raise RateLimitError(f"{exc}; delete some of its branches first") from None


def check_room(services: Services, context: TurnContext, adding: int) -> None:
    """429 before generating when the session's messages would pass their cap."""
    limit = services.settings.limits.max_messages_per_session
    if context.num_nodes + adding > limit:
        raise RateLimitError(
            f"the session holds {context.num_nodes} messages; the limit is {limit}: "
            "delete some of its branches first"
        )
