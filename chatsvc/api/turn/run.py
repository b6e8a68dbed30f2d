"""One turn of a session: new messages in, assistant message out, stored once.

Life of a turn (the order is what keeps Redis consistent), each step below in
this order, ``begin_turn`` then ``run_turn``:

    validate body            -> 400, nothing touched (the endpoint, before begin_turn)
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

from chatsvc import affinity
from chatsvc.api.shared.errors import NotFoundError, RateLimitError, ServiceUnavailableError
from chatsvc.api.shared.generation import SampleResult, generate, record_finished
from chatsvc.api.shared.store_access import UNKNOWN_SESSION, get_session
from chatsvc.api.turn.commit import answer_record, commit_turn
from chatsvc.api.turn.context import TurnContext, check_room, check_storage, read_context
from chatsvc.api.turn.hold import TurnHold, take_hold
from chatsvc.api.turn.prompt import PreparedTurn, prepare_turn
from chatsvc.api.turn.spec import StoredTurn, TurnSpec
from chatsvc.logs import text_for_log
from chatsvc.protocol import SamplingParams
from chatsvc.service import Services
from chatsvc.store.records import MessageRecord, ResponseRecord, TenantRecord

log = logging.getLogger(__name__)

# Builds the Responses API record stored with a turn.
ResponseFactory = Callable[[PreparedTurn, MessageRecord, SampleResult], ResponseRecord]


async def begin_turn(
    services: Services,
    tenant: TenantRecord,
    session_id: str | None,
    spec: TurnSpec,
    sampling: SamplingParams,
    requested: int | None,
) -> tuple[PreparedTurn, TurnHold]:
    """Lock, read the branch and build the prompt; on any failure nothing stays held
    or written. ``session_id`` None: a session this turn makes (stored turns only)."""
    new_session = session_id is None
    if new_session:
        if spec.store:
            limit = services.settings.limits.max_sessions_per_tenant
            if await services.store.sessions.count(tenant.id) >= limit:
                raise RateLimitError(f"this tenant already has {limit} sessions; delete some first")
        # No one else knows the new session's id: no lock to take.
        hold = await take_hold(services, tenant.id, None, locked=False)
    else:
        if await get_session(services, tenant, session_id) is None:
            raise NotFoundError(UNKNOWN_SESSION)
        hold = await take_hold(services, tenant.id, session_id, locked=spec.store)
    try:
        if new_session:
            session_id = secrets.token_hex(16)
            context = TurnContext(None)
        else:
            # Read under the lock: the turn before this one may have finished since.
            context = await read_context(services, tenant, session_id, spec)
        check_room(services, context, len(spec.inputs) + 1)
        if spec.store:
            await check_storage(services, tenant.id, None if new_session else session_id)
        prepared = await prepare_turn(
            services, tenant, session_id, new_session, context, spec, sampling, requested
        )
    except BaseException:
        await hold.release()
        raise
    return prepared, hold


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
    sample = SampleResult()
    try:
        async for delta in generate(services, turn.request):
            sample.add(delta)
            if delta.text:
                yield delta.text
        if not sample.finished:
            services.metrics.observe_failure(turn.spec.endpoint, "aborted")
            raise ServiceUnavailableError("the generation was aborted; the turn was not stored")
        output = await answer_record(services, turn, sample)
        if turn.spec.store:
            record = None if response is None else response(turn, output, sample)
            await commit_turn(services, tenant, turn, output, record, hold.lock)
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
        record_finished(services, turn.spec.endpoint, turn.request.labels, [sample])
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
