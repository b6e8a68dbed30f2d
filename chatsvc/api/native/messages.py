"""Posting a message (a turn, a regenerated answer, an edit), a JSON answer or SSE.

SSE events: ``delta`` (data ``{"text": ...}``) for each piece of the answer,
then either ``done`` (data: the same TurnResult the JSON answer carries, sent
only after the turn is stored) or ``error`` (data: the error body; the turn
was not stored).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from litestar import Controller, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, JSONBody, Parameter
from litestar.response import ServerSentEvent, ServerSentEventMessage

from chatsvc.api.native.branches import branch_view, message_view
from chatsvc.api.native.schemas import (
    MessageList,
    MessageView,
    PostMessage,
    TextDelta,
    Timings,
    TurnResult,
)
from chatsvc.api.native.schemas import Usage as UsageView
from chatsvc.api.shared.deps import ServicesDep, TenantDep
from chatsvc.api.shared.errors import (
    ApiError,
    InvalidRequestError,
    documented_errors,
    error_body,
    log_store_unavailable,
    store_failure,
)
from chatsvc.api.shared.openapi_streams import StreamingOperation
from chatsvc.api.shared.rendering import check_text
from chatsvc.api.shared.sampling import build_sampling
from chatsvc.api.shared.store_access import read_branch, read_page
from chatsvc.api.turn.run import begin_turn, run_turn
from chatsvc.api.turn.spec import StoredTurn, TurnSpec
from chatsvc.store import StoreUnavailableError

# A branch is shown in pages of this many messages unless the request asks for
# fewer (or, up to the maximum, more): the store reads only the page.
DEFAULT_MESSAGES_PAGE = 100
MAX_MESSAGES_PAGE = 1000


class MessageController(Controller):
    path = "/sessions/{session_id:str}/messages"
    tags = ["sessions"]

    @post(
        "/",
        summary="Send a user message (or regenerate an answer) and get the assistant's answer",
        operation_class=StreamingOperation,
        status_code=200,
        responses={
            200: ResponseSpec(
                TurnResult,
                description="The stored turn; with stream: true, text/event-stream of "
                "delta events then a done event carrying this body",
                generate_examples=False,
            ),
            **documented_errors(400, 401, 404, 409, 413, 429, 500, 503),
        },
    )
    async def post_message(
        self,
        session_id: FromPath[str],
        data: JSONBody[PostMessage],
        services: ServicesDep,
        tenant: TenantDep,
    ) -> Response[TurnResult] | ServerSentEvent:
        """One turn. 409 while another turn of the session runs; 429 over the tenant's
        concurrent-generation limit. With ``stream: true`` the answer is an SSE stream
        (with ``beam_width`` one ``delta`` at the end: the best beam is known only then).
        ``regenerate`` / ``parent_message_id`` branch (see PostMessage)."""
        spec = _spec(services, data)
        sampling, requested = build_sampling(
            services,
            max_tokens=data.max_tokens,
            temperature=data.temperature,
            top_p=data.top_p,
            top_k=data.top_k,
            seed=data.seed,
            stop=data.stop,
            beam_width=data.beam_width,
            length_penalty=data.length_penalty,
            early_stopping=data.early_stopping,
        )
        turn, hold = await begin_turn(services, tenant, session_id, spec, sampling, requested)
        events = run_turn(services, tenant, turn, hold)
        if data.stream:
            # The background task is a second, idempotent release: it covers a
            # stream whose body never started (client gone before the first byte).
            return ServerSentEvent(_sse(events), background=BackgroundTask(hold.release))
        result = None
        async for item in events:
            if isinstance(item, StoredTurn):
                result = turn_result(item)
        assert result is not None  # run_turn raises unless it yields a result
        # Wrapped in a Response (like the SSE branch) so the handler keeps no
        # fixed media type and each branch sends its own Content-Type.
        return Response(result)

    @get(
        "/",
        summary="A branch of the session (the active one by default), oldest first",
        responses=documented_errors(400, 401, 404, 503),
    )
    async def list_messages(
        self,
        session_id: FromPath[str],
        services: ServicesDep,
        tenant: TenantDep,
        leaf_id: str | None = Parameter(
            default=None, max_length=64, description="show the branch ending at this message"
        ),
        limit: int = Parameter(
            default=DEFAULT_MESSAGES_PAGE,
            ge=1,
            le=MAX_MESSAGES_PAGE,
            description="the most messages in this page",
        ),
        after: str | None = Parameter(
            default=None, max_length=64, description="start after this message of the branch"
        ),
    ) -> MessageList:
        """Each message says its siblings (other versions at its place); ``leaf_id``
        shows another branch without making it active. Pages of ``limit`` messages,
        oldest first; ``has_more``: pass the last id as ``after`` for the next."""
        if leaf_id is None:
            page = await read_page(
                services, tenant, session_id, limit=limit, after=after, order="asc"
            )
            pairs = zip(page.messages, page.siblings, strict=True)
            return MessageList(
                session_id=session_id,
                messages=[message_view(message, siblings) for message, siblings in pairs],
                continuations=page.continuations,
                has_more=page.has_more,
            )
        # Another branch has no index of its own: it is read whole, and paged here.
        view = branch_view(session_id, await read_branch(services, tenant, session_id, leaf_id))
        start = 0
        if after is not None:
            ids = [m.id for m in view.messages]
            if after not in ids:
                raise InvalidRequestError(f"after names no message of this branch: {after!r}")
            start = ids.index(after) + 1
        view.has_more = len(view.messages) > start + limit
        view.messages = view.messages[start : start + limit]
        return view


def _spec(services, data: PostMessage) -> TurnSpec:
    if data.regenerate:
        if data.content is not None:
            raise InvalidRequestError("regenerate takes no content (it answers a stored message)")
        return TurnSpec(parent_id=data.parent_message_id, regenerate=True)
    if data.content is None:
        raise InvalidRequestError("content is required (or regenerate: true)")
    check_text(data.content, services)
    return TurnSpec(inputs=(("user", data.content),), parent_id=data.parent_message_id)


def turn_result(turn: StoredTurn) -> TurnResult:
    """The native API's answer for a stored turn."""
    m = turn.sample.metrics
    out = turn.output
    return TurnResult(
        session_id=turn.session_id,
        message=MessageView(
            id=out.id,
            role="assistant",
            content=out.text,
            created_at=out.created_at,
            parent_id=out.parent_id,
        ),
        finish_reason=turn.sample.finish_reason,
        usage=UsageView(
            prompt_tokens=m.prompt_tokens,
            cached_tokens=m.cached_prompt_tokens,
            completion_tokens=m.completion_tokens,
            cached_tokens_by_tier=dict(m.cached_tokens_by_tier),
        ),
        timings=Timings(ttft_s=m.ttft_s, tpot_s=m.tpot_s, latency_s=m.latency_s),
        prefix_reused=turn.reused,
    )


async def _sse(events: AsyncIterator[str | StoredTurn]) -> AsyncIterator[ServerSentEventMessage]:
    try:
        async for item in events:
            if isinstance(item, StoredTurn):
                data = msgspec.json.encode(turn_result(item)).decode()
                yield ServerSentEventMessage(event="done", data=data)
            else:
                data = msgspec.json.encode(TextDelta(text=item)).decode()
                yield ServerSentEventMessage(event="delta", data=data)
    except ApiError as exc:
        body = error_body(exc.error_type, exc.message)
        yield ServerSentEventMessage(event="error", data=msgspec.json.encode(body).decode())
    except StoreUnavailableError as exc:
        log_store_unavailable(None, exc)
        body = error_body(*store_failure(exc, "the turn"))
        yield ServerSentEventMessage(event="error", data=msgspec.json.encode(body).decode())
    finally:
        await events.aclose()
