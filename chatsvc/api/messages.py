"""Posting a user message: a JSON answer, or Server-Sent Events with ``stream: true``.

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
from litestar.params import FromPath, JSONBody
from litestar.response import ServerSentEvent, ServerSentEventMessage

from chatsvc.api.deps import ServicesDep, TenantDep
from chatsvc.api.errors import (
    STORE_UNAVAILABLE_MESSAGE,
    ApiError,
    NotFoundError,
    documented_errors,
    error_body,
    log_store_unavailable,
)
from chatsvc.api.openapi_streams import StreamingOperation
from chatsvc.api.schemas import MessageList, MessageView, PostMessage, TextDelta, TurnResult
from chatsvc.api.turn import UNKNOWN_SESSION, begin_turn, run_turn
from chatsvc.store import InvalidInputError, StoreUnavailableError


class MessageController(Controller):
    path = "/sessions/{session_id:str}/messages"
    tags = ["sessions"]

    @post(
        "/",
        summary="Send a user message and get the assistant's answer",
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
        concurrent-generation limit. With ``stream: true`` the answer is an SSE stream."""
        turn, hold = await begin_turn(services, tenant, session_id, data)
        events = run_turn(services, tenant, turn, hold)
        if data.stream:
            # The background task is a second, idempotent release: it covers a
            # stream whose body never started (client gone before the first byte).
            return ServerSentEvent(_sse(events), background=BackgroundTask(hold.release))
        result = None
        async for item in events:
            if isinstance(item, TurnResult):
                result = item
        assert result is not None  # run_turn raises unless it yields a result
        # Wrapped in a Response (like the SSE branch) so the handler keeps no
        # fixed media type and each branch sends its own Content-Type.
        return Response(result)

    @get(
        "/",
        summary="The session's history, oldest first",
        responses=documented_errors(400, 401, 404, 503),
    )
    async def list_messages(
        self, session_id: FromPath[str], services: ServicesDep, tenant: TenantDep
    ) -> MessageList:
        try:
            messages = await services.store.get_messages(tenant.id, session_id)
        except InvalidInputError:
            messages = None
        if messages is None:
            raise NotFoundError(UNKNOWN_SESSION)
        return MessageList(
            session_id=session_id,
            messages=[
                MessageView(role=m.role, content=m.text, created_at=m.created_at) for m in messages
            ],
        )


async def _sse(events: AsyncIterator[str | TurnResult]) -> AsyncIterator[ServerSentEventMessage]:
    try:
        async for item in events:
            if isinstance(item, TurnResult):
                data = msgspec.json.encode(item).decode()
                yield ServerSentEventMessage(event="done", data=data)
            else:
                data = msgspec.json.encode(TextDelta(text=item)).decode()
                yield ServerSentEventMessage(event="delta", data=data)
    except ApiError as exc:
        body = error_body(exc.error_type, exc.message)
        yield ServerSentEventMessage(event="error", data=msgspec.json.encode(body).decode())
    except StoreUnavailableError as exc:
        log_store_unavailable(None, exc)
        body = error_body(
            "store_unavailable", f"the turn was not stored: {STORE_UNAVAILABLE_MESSAGE}"
        )
        yield ServerSentEventMessage(event="error", data=msgspec.json.encode(body).decode())
    finally:
        await events.aclose()
