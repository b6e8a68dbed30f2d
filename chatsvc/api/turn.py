"""One turn of a session: user message in, assistant message out, history appended once.

Life of a turn (the order is what keeps Redis consistent):

    validate body            -> 400, nothing touched
    load session             -> 404
    take the turn lock       -> 409 (another turn of this session is running)
    take a generation slot   -> 429
    reload session, build the prompt, fit the context -> 400, lock released
    generate (streamed or not)
    on finish: append_turn (user + assistant + token history in one atomic write,
               only while this turn still holds the lock) -> 409 if it lost it
    release lock and slot

A turn that does not finish (client gone, engine abort, error) is not
acknowledged: nothing is appended and the history stays as it was, so a
retried message never sees a half answer in its context.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio

from chatsvc import affinity
from chatsvc.api import generation as gen
from chatsvc.api.errors import ConflictError, NotFoundError, ServiceUnavailableError
from chatsvc.api.schemas import MessageView, PostMessage, Timings, TurnResult, Usage
from chatsvc.logs import text_for_log
from chatsvc.protocol import GenerationRequest, SamplingParams
from chatsvc.service import Services
from chatsvc.store import InvalidInputError, TurnLockLostError
from chatsvc.store.lock import RedisLock
from chatsvc.store.records import MessageRecord, SessionRecord, TenantRecord
from chatsvc.store.records import Usage as UsageRecord

UNKNOWN_SESSION = "no such session"
log = logging.getLogger(__name__)


@dataclass
class PreparedTurn:
    session: SessionRecord
    user: MessageRecord
    request: GenerationRequest
    reused: bool


class TurnHold:
    """The turn lock and the generation slot of one turn; ``release`` is idempotent.

    ``lock`` is what the turn's commit is fenced by (see ``Store.append_turn``).
    """

    def __init__(self, slot: gen.StreamSlot, lock_cm, lock: RedisLock) -> None:
        self._slot = slot
        self._lock_cm = lock_cm
        self.lock = lock
        self._released = False

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            # Shielded: on a client disconnect this runs inside a cancelled scope,
            # and an unshielded await would leave the lock held until its TTL.
            with anyio.CancelScope(shield=True):
                await self._lock_cm.__aexit__(None, None, None)
        finally:
            self._slot.release()


async def begin_turn(
    services: Services, tenant: TenantRecord, session_id: str, body: PostMessage
) -> tuple[PreparedTurn, TurnHold]:
    """Validate, lock and build the prompt; on any failure nothing stays held or written."""
    store = services.store
    gen.check_text(body.content, services)
    sampling, requested = gen.build_sampling(
        services,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=body.stop,
    )
    if await get_session(services, tenant, session_id) is None:
        raise NotFoundError(UNKNOWN_SESSION)
    # The lock comes before the slot: clients racing on one session get 409 and
    # never hold one of the tenant's generation slots while they lose the race.
    lock_cm = store.turn_lock(tenant.id, session_id)
    lock = await lock_cm.__aenter__()
    try:
        slot = gen.StreamSlot(services, tenant.id)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await lock_cm.__aexit__(None, None, None)
        raise
    hold = TurnHold(slot, lock_cm, lock)
    try:
        prepared = await _prepare(services, tenant, session_id, body.content, sampling, requested)
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
    text: str,
    sampling: SamplingParams,
    requested: int | None,
) -> PreparedTurn:
    store = services.store
    # Reloaded under the lock: the turn before this one may have finished since.
    session = await store.get_session(tenant.id, session_id)
    history = await store.get_messages(tenant.id, session_id)
    if session is None or history is None:
        raise NotFoundError(UNKNOWN_SESSION)
    messages = [{"role": m.role, "content": m.text} for m in history]
    messages.append({"role": "user", "content": text})
    prompt, reused = await gen.format_chat(
        services.engine.chat_format.extend, session.token_ids, messages
    )
    sampling = gen.fit_context(services, len(prompt), sampling, requested)
    system = None
    if session.system_prompt_id is not None:
        system = await store.get_system_prompt(tenant.id, session.system_prompt_id)
    # "session" lets the engine tag the blocks this turn computes with their session,
    # so deleting the session finds them (it only tags: statistics ignore it).
    labels = {"tenant": tenant.id, "session": session.id}
    if session.system_prompt_id is not None:
        labels["system_prompt"] = session.system_prompt_id
    if not reused and session.token_ids:
        services.usage.record_lost_reuse(labels)
    request = GenerationRequest(
        request_id=gen.new_request_id("turn"),
        prompt_token_ids=prompt,
        sampling=sampling,
        namespace=gen.namespace_for(tenant, gen.shared_prefix_len(prompt, system)),
        labels=labels,
    )
    start = len(session.token_ids) if reused else 0
    user = MessageRecord(role="user", text=text, token_ids=prompt[start:])
    return PreparedTurn(session=session, user=user, request=request, reused=reused)


async def run_turn(
    services: Services, tenant: TenantRecord, turn: PreparedTurn, hold: TurnHold
) -> AsyncIterator[str | TurnResult]:
    """Yield text pieces, then the TurnResult once the turn is stored; releases ``hold``."""
    sample = gen.SampleResult()
    try:
        async for delta in gen.generate(services, turn.request):
            sample.add(delta)
            if delta.text:
                yield delta.text
        if not sample.finished:
            services.metrics.observe_failure("session_turn", "aborted")
            raise ServiceUnavailableError("the generation was aborted; the turn was not stored")
        result = await _store_turn(services, tenant, turn, sample, hold.lock)
        m = sample.metrics
        log.info(
            "turn stored: session %s, engine request %s, %d prompt tokens (%d cached), "
            "%d completion tokens",
            turn.session.id,
            turn.request.request_id,
            m.prompt_tokens,
            m.cached_prompt_tokens,
            m.completion_tokens,
        )
        log.debug(
            "turn text: user %s, assistant %s",
            text_for_log(turn.user.text),
            text_for_log(sample.text),
        )
        gen.record_finished(services, "session_turn", turn.request.labels, [sample])
        affinity.record_turn(services, turn, m, len(sample.token_ids))
        yield result
    finally:
        await hold.release()


async def _store_turn(
    services: Services,
    tenant: TenantRecord,
    turn: PreparedTurn,
    sample: gen.SampleResult,
    lock: RedisLock,
) -> TurnResult:
    m = sample.metrics
    # Text and tokens stored must agree (a stop string cuts the text, not the tokens),
    # or the next turn's render no longer extends the stored tokens.
    answer_ids = await gen.format_chat(
        services.engine.chat_format.answer_token_ids,
        turn.request.prompt_token_ids,
        sample.token_ids,
        sample.text,
    )
    assistant = MessageRecord(
        role="assistant",
        text=sample.text,
        token_ids=answer_ids,
        usage=UsageRecord(
            prompt_tokens=m.prompt_tokens,
            cached_tokens=m.cached_prompt_tokens,
            completion_tokens=m.completion_tokens,
            ttft_s=m.ttft_s,
        ),
    )
    # Shielded so a disconnect arriving during the write cannot cut the MULTI/EXEC
    # round trip in half; the write itself is all-or-nothing in Redis either way.
    # The request id names the turn: a commit resent after a lost reply is then
    # recognised as already applied instead of appending the turn twice.
    try:
        with anyio.CancelScope(shield=True):
            await services.store.append_turn(
                tenant.id,
                turn.session.id,
                turn.user,
                assistant,
                lock=lock,
                turn_id=turn.request.request_id,
                token_ids=[*turn.request.prompt_token_ids, *answer_ids],
            )
    except TurnLockLostError:
        services.metrics.observe_failure("session_turn", "lock_lost")
        raise ConflictError(
            "the session's turn lock expired while this turn ran (a stall or a Redis "
            "failover longer than its TTL) and another turn may have taken over; "
            "this turn was not stored, send the message again",
            error_type="turn_lock_lost",
        ) from None
    return TurnResult(
        session_id=turn.session.id,
        message=MessageView(role="assistant", content=sample.text, created_at=assistant.created_at),
        finish_reason=sample.finish_reason,
        usage=Usage(
            prompt_tokens=m.prompt_tokens,
            cached_tokens=m.cached_prompt_tokens,
            completion_tokens=m.completion_tokens,
            cached_tokens_by_tier=dict(m.cached_tokens_by_tier),
        ),
        timings=Timings(ttft_s=m.ttft_s, tpot_s=m.tpot_s, latency_s=m.latency_s),
        prefix_reused=turn.reused,
    )
