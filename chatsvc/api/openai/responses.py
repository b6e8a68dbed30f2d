"""OpenAI's Responses API on top of sessions: ``/v1/responses``.

A response is one turn of a session. ``previous_response_id`` names the turn
to continue (a node of the session's message tree), so two responses on one
previous response are two branches and each prompt is exactly its parent's
stored tokens plus the new input: the parent's KV is reused. A response with
neither ``previous_response_id`` nor ``conversation`` starts a new session
(kind "response", listed under /sessions too); ``conversation`` appends to a
conversation (a session) and its active branch. ``store: false`` runs the turn
and writes nothing at all (no session, no lock, no record).

One turn at a time per session: a response on a session that is generating
gets 409, as a message would.
"""

from __future__ import annotations

import secrets

from litestar import Controller, Response, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, JSONBody, Parameter
from litestar.response import ServerSentEvent

from chatsvc.api.openai.caller_ids import affinity_headers, check_caller_ids, log_caller_ids
from chatsvc.api.openai.response_schemas import (
    CreateResponse,
    ItemList,
    ResponseDeleted,
    ResponseObject,
)
from chatsvc.api.openai.response_stream import response_events
from chatsvc.api.openai.response_views import (
    DEFAULT_PAGE,
    MAX_PAGE,
    ResponseMeta,
    item_list,
    item_view,
    page_window,
    stored_response_view,
)
from chatsvc.api.shared.deps import ServicesDep, TenantDep
from chatsvc.api.shared.errors import InvalidRequestError, NotFoundError, documented_errors
from chatsvc.api.shared.openapi_streams import StreamingOperation
from chatsvc.api.shared.rendering import check_text
from chatsvc.api.shared.sampling import build_sampling
from chatsvc.api.shared.session_kv import delete_with_kv
from chatsvc.api.turn.run import begin_turn, run_turn
from chatsvc.api.turn.spec import StoredTurn, TurnSpec
from chatsvc.service import Services
from chatsvc.store.errors import MalformedIdError
from chatsvc.store.records import ResponseRecord, TenantRecord
from chatsvc.store.responses import RESPONSE_ID_PREFIX, new_response_id, response_session
from chatsvc.store.validate import check_metadata

ENDPOINT = "responses"
UNKNOWN_RESPONSE = "no such response"


class ResponsesController(Controller):
    path = "/v1/responses"
    tags = ["openai"]

    @post(
        "/",
        summary="Create a response (OpenAI Responses API)",
        operation_class=StreamingOperation,
        status_code=200,
        responses={
            200: ResponseSpec(
                ResponseObject,
                description="With stream: true, text/event-stream of response.* events "
                "(response.created ... response.completed), each with its sequence_number",
                generate_examples=False,
            ),
            **documented_errors(400, 401, 404, 409, 413, 429, 500, 503),
        },
    )
    async def create_response(
        self, data: JSONBody[CreateResponse], services: ServicesDep, tenant: TenantDep
    ) -> Response[ResponseObject] | ServerSentEvent:
        """One turn: ``input`` after the stored turn ``previous_response_id`` names, after a
        ``conversation``'s active branch, or in a new session."""
        spec, session_id, meta = await _plan(services, tenant, data)
        sampling, requested = build_sampling(
            services,
            max_tokens=data.max_output_tokens,
            temperature=data.temperature,
            top_p=data.top_p,
            seed=None,
            stop=[],
        )
        # Unset fields took the served model's defaults: the response names what ran.
        meta.temperature, meta.top_p = sampling.temperature, sampling.top_p
        turn, hold = await begin_turn(services, tenant, session_id, spec, sampling, requested)
        if meta.store:
            meta.id = new_response_id(turn.session_id)
        log_caller_ids(ENDPOINT, meta.id, data.prompt_cache_key, data.user, data.safety_identifier)

        def record(prepared, output, sample) -> ResponseRecord:
            return meta.record(prepared.session_id, prepared.inputs, output, sample.finish_reason)

        events = run_turn(services, tenant, turn, hold, response=record)
        headers = affinity_headers(data.prompt_cache_key)
        if data.stream:
            return ServerSentEvent(
                response_events(meta, turn.output_id, events),
                background=BackgroundTask(hold.release),
                headers=headers,
            )
        finished = None
        async for item in events:
            if isinstance(item, StoredTurn):
                finished = meta.finished(item.output, item.sample.finish_reason)
        assert finished is not None  # run_turn raises unless it yields a result
        return Response(finished, headers=headers)

    @get(
        "/{response_id:str}",
        summary="Retrieve a stored response",
        responses=documented_errors(400, 401, 404, 503),
    )
    async def retrieve_response(
        self, response_id: FromPath[str], services: ServicesDep, tenant: TenantDep
    ) -> ResponseObject:
        record = await _record(services, tenant, response_id)
        (output,) = await _messages(services, tenant, record, [record.output_id])
        return stored_response_view(record, output)

    @delete(
        "/{response_id:str}",
        summary="Delete a stored response",
        status_code=200,
        responses=documented_errors(400, 401, 404, 409, 503),
    )
    async def delete_response(
        self, response_id: FromPath[str], services: ServicesDep, tenant: TenantDep
    ) -> ResponseDeleted:
        """Its messages go too unless a conversation holds them or another branch
        (a later response, a regenerated answer) uses them; so does the KV of the
        text it removed, in every tier."""
        record = await _record(services, tenant, response_id)
        await delete_with_kv(
            services,
            tenant,
            record.session_id,
            lambda lock, write_id: services.store.responses.delete(
                tenant.id, record.id, lock=lock, write_id=write_id
            ),
        )
        return ResponseDeleted(id=record.id)

    @get(
        "/{response_id:str}/input_items",
        summary="The input items of a stored response",
        responses=documented_errors(400, 401, 404, 503),
    )
    async def input_items(
        self,
        response_id: FromPath[str],
        services: ServicesDep,
        tenant: TenantDep,
        after: str | None = Parameter(default=None, max_length=64),
        limit: int = Parameter(default=DEFAULT_PAGE, ge=1, le=MAX_PAGE),
        order: str = Parameter(default="desc", pattern="^(asc|desc)$"),
    ) -> ItemList:
        """The messages the response was asked to answer (``order`` desc: newest first)."""
        record = await _record(services, tenant, response_id)
        ids, has_more = page_window(record.input_ids, after=after, limit=limit, order=order)
        messages = await _messages(services, tenant, record, ids)  # the page's alone
        return item_list([item_view(m) for m in messages if m is not None], has_more)


async def _record(services: Services, tenant: TenantRecord, response_id: str) -> ResponseRecord:
    try:
        record = await services.store.responses.get(tenant.id, response_id)
    except MalformedIdError:
        record = None
    if record is None:
        raise NotFoundError(UNKNOWN_RESPONSE)
    return record


async def _messages(services, tenant, record: ResponseRecord, ids: list[str]):
    found = await services.store.tree.messages_by_id(tenant.id, record.session_id, ids)
    if found is None:  # the session went between the two reads
        raise NotFoundError(UNKNOWN_RESPONSE)
    return found


async def _plan(
    services: Services, tenant: TenantRecord, data: CreateResponse
) -> tuple[TurnSpec, str | None, ResponseMeta]:
    """Check the request and decide where the turn goes; 4xx before anything is touched."""
    model = services.engine.model_name
    if data.model != model:
        raise NotFoundError(
            f"model {data.model!r} is not served here; GET /v1/models lists {model!r}",
            error_type="model_not_found",
        )
    refused = data.refused_fields()
    if refused:
        raise InvalidRequestError(f"not supported here: {'; '.join(refused)}")
    check_caller_ids(data.prompt_cache_key, data.user, data.safety_identifier)
    try:
        metadata = check_metadata(data.metadata)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(str(exc)) from None
    inputs = _inputs(services, data)
    store = data.store is not False
    conversation = data.conversation_id()
    if conversation is not None and data.previous_response_id is not None:
        raise InvalidRequestError("give previous_response_id or conversation, not both")
    if conversation is not None and not store:
        raise InvalidRequestError("store: false cannot add to a conversation")
    parent = session_id = None
    if data.previous_response_id is not None:
        previous = await _record(services, tenant, data.previous_response_id)
        session_id, parent = previous.session_id, previous.output_id
    elif conversation is not None:
        session_id = conversation
    if data.instructions is not None:
        check_text(data.instructions, services, "instructions")
    spec = TurnSpec(
        inputs=inputs,
        parent_id=parent,
        instructions=data.instructions,
        store=store,
        endpoint=ENDPOINT,
    )
    meta = ResponseMeta(
        # Replaced by an id naming the session for a stored response; this one names
        # none, so it can never be retrieved.
        id=RESPONSE_ID_PREFIX + secrets.token_hex(16),
        model=model,
        store=store,
        instructions=data.instructions,
        metadata=metadata,
        previous_response_id=data.previous_response_id,
        conversation_id=conversation,
        temperature=1.0 if data.temperature is None else data.temperature,
        top_p=1.0 if data.top_p is None else data.top_p,
        max_output_tokens=data.max_output_tokens,
        prompt_cache_key=data.prompt_cache_key,
        safety_identifier=data.safety_identifier,
        user=data.user,
    )
    assert response_session(meta.id) is None
    return spec, session_id, meta


def _inputs(services: Services, data: CreateResponse) -> tuple[tuple[str, str], ...]:
    """The input as (role, text) messages; 400 for empty, oversized or misplaced ones."""
    if isinstance(data.input, str):
        return (("user", check_text(data.input, services, "input")),)
    limits = services.settings.limits
    if not data.input:
        raise InvalidRequestError("input must hold at least one message")
    if len(data.input) > limits.max_messages:
        raise InvalidRequestError(
            f"input has {len(data.input)} items; the limit is {limits.max_messages}"
        )
    if data.input[-1].role == "assistant":
        raise InvalidRequestError("the last input item must not be the assistant's")
    messages = []
    for i, item in enumerate(data.input):
        text = check_text(item.text(), services, f"input[{i}]")
        messages.append((item.stored_role(), text))
    total = sum(len(text) for _, text in messages)
    if total > limits.max_message_chars * 4:
        raise InvalidRequestError(f"the input holds {total} characters; too long")
    return tuple(messages)
