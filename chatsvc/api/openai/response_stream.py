"""The Server-Sent Events of a streamed response, in the order the openai SDK expects.

    response.created            the response, in_progress, no output yet
    response.in_progress
    response.output_item.added  the answer's message item, empty
    response.content_part.added its output_text part, empty
    response.output_text.delta  ... one per piece of text
    response.output_text.done   the whole text         } sent once the turn is
    response.content_part.done                         } stored (with store:
    response.output_item.done                          } true), so they mean
    response.completed          (or .incomplete)       } it was acknowledged

On failure after the stream began, an ``error`` event (our error type as its
code) and ``response.failed`` (the response with its ``error``) end it; nothing
was stored. Every event carries its ``sequence_number``, from 0 up.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar.response import ServerSentEventMessage

from chatsvc.api.openai.response_schemas import Item, OutputText, ResponseError
from chatsvc.api.openai.response_views import ResponseMeta
from chatsvc.api.shared.errors import ApiError, log_store_unavailable, store_failure
from chatsvc.api.turn.spec import StoredTurn
from chatsvc.store import StoreUnavailableError


class _Events:
    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> ServerSentEventMessage:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return ServerSentEventMessage(event=kind, data=msgspec.json.encode(body).decode())


async def response_events(
    meta: ResponseMeta, output_id: str, turn_events: AsyncIterator[str | StoredTurn]
) -> AsyncIterator[ServerSentEventMessage]:
    """The events of one response whose turn yields ``turn_events`` (see run_turn)."""
    event = _Events()
    where = {"item_id": output_id, "output_index": 0, "content_index": 0}
    started = meta.view("in_progress", [])
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    empty = Item(id=output_id, role="assistant", content=[], status="in_progress")
    yield event("response.output_item.added", output_index=0, item=empty)
    yield event("response.content_part.added", **where, part=OutputText(text=""))
    try:
        async for item in turn_events:
            if isinstance(item, StoredTurn):
                final = meta.finished(item.output, item.sample.finish_reason)
                text = item.output.text
                yield event("response.output_text.done", **where, text=text, logprobs=[])
                yield event("response.content_part.done", **where, part=OutputText(text=text))
                yield event("response.output_item.done", output_index=0, item=final.output[0])
                incomplete = final.status == "incomplete"
                yield event(
                    "response.incomplete" if incomplete else "response.completed", response=final
                )
            else:
                yield event("response.output_text.delta", **where, delta=item, logprobs=[])
    except ApiError as exc:
        for message in _failed(event, meta, exc.error_type, exc.message):
            yield message
    except StoreUnavailableError as exc:
        log_store_unavailable(None, exc)
        code, message = store_failure(exc, "the response")
        for failed in _failed(event, meta, code, message):
            yield failed
    finally:
        await turn_events.aclose()


def _failed(event: _Events, meta: ResponseMeta, code: str, message: str):
    yield event("error", code=code, message=message, param=None)
    error = ResponseError(code="server_error", message=message)
    yield event("response.failed", response=meta.view("failed", [], error=error))
