"""Stored messages and responses as the Responses and Conversations APIs show them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from chatsvc.api.openai.response_schemas import (
    ConversationView,
    IncompleteDetails,
    InputTextView,
    InputTokensDetails,
    Item,
    ItemList,
    OutputText,
    OutputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from chatsvc.api.shared.errors import InvalidRequestError
from chatsvc.store.records import MessageRecord, ResponseRecord, Usage

MAX_PAGE = 100
DEFAULT_PAGE = 20


def item_view(message: MessageRecord, status: str = "completed") -> Item:
    """A stored message as an item: an answer holds ``output_text``, the rest ``input_text``."""
    if message.role == "assistant":
        content = [OutputText(text=message.text)]
    else:
        content = [InputTextView(text=message.text)]
    return Item(id=message.id, role=message.role, content=content, status=status)


def usage_view(usage: Usage | None) -> ResponseUsage | None:
    if usage is None:
        return None
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.cached_tokens,
            cache_write_tokens=usage.prompt_tokens - usage.cached_tokens,
        ),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
    )


@dataclass
class ResponseMeta:
    """Everything a response echoes besides its output, fixed when it is created."""

    id: str
    model: str
    store: bool
    created_at: float = field(default_factory=time.time)
    instructions: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    previous_response_id: str | None = None
    conversation_id: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    max_output_tokens: int | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    user: str | None = None

    def record(self, session_id: str, inputs, output: MessageRecord, finish: str) -> ResponseRecord:
        """The record stored with the turn."""
        incomplete = finish == "length"
        return ResponseRecord(
            id=self.id,
            session_id=session_id,
            created_at=self.created_at,
            completed_at=time.time(),
            model=self.model,
            status="incomplete" if incomplete else "completed",
            incomplete_reason="max_output_tokens" if incomplete else None,
            input_ids=[m.id for m in inputs],
            output_id=output.id,
            instructions=self.instructions,
            metadata=self.metadata,
            previous_response_id=self.previous_response_id,
            conversation_id=self.conversation_id,
            temperature=self.temperature,
            top_p=self.top_p,
            max_output_tokens=self.max_output_tokens,
            prompt_cache_key=self.prompt_cache_key,
            safety_identifier=self.safety_identifier,
            user=self.user,
        )

    def view(
        self,
        status: str,
        output: list[Item],
        *,
        usage: ResponseUsage | None = None,
        completed_at: float | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        return ResponseObject(
            id=self.id,
            created_at=int(self.created_at),
            model=self.model,
            status=status,
            output=output,
            error=error,
            incomplete_details=(
                IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
            ),
            instructions=self.instructions,
            metadata=self.metadata,
            previous_response_id=self.previous_response_id,
            conversation=(
                None if self.conversation_id is None else ConversationView(id=self.conversation_id)
            ),
            max_output_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            usage=usage,
            store=self.store,
            completed_at=None if completed_at is None else int(completed_at),
            prompt_cache_key=self.prompt_cache_key,
            safety_identifier=self.safety_identifier,
            user=self.user,
        )

    def finished(self, output: MessageRecord, finish: str) -> ResponseObject:
        status = "incomplete" if finish == "length" else "completed"
        return self.view(
            status,
            [item_view(output, status)],
            usage=usage_view(output.usage),
            completed_at=time.time(),
        )

    @classmethod
    def of_record(cls, record: ResponseRecord) -> ResponseMeta:
        fields = {f: getattr(record, f) for f in cls.__dataclass_fields__ if f != "store"}
        return cls(store=True, **fields)


def stored_response_view(record: ResponseRecord, output: MessageRecord | None) -> ResponseObject:
    """A stored response; without its answer (deleted as a conversation item), no output."""
    meta = ResponseMeta.of_record(record)
    items = [] if output is None else [item_view(output, record.status)]
    return meta.view(
        record.status,
        items,
        usage=None if output is None else usage_view(output.usage),
        completed_at=record.completed_at,
    )


def page_window(
    ids: list[str], *, after: str | None, limit: int, order: str
) -> tuple[list[str], bool]:
    """The ids of one page of ``ids`` (oldest first as given) in ``order``, after the id
    ``after``, and whether more follow: a caller reads only the page's records."""
    if order not in ("asc", "desc"):
        raise InvalidRequestError("order must be 'asc' or 'desc'")
    ordered = ids if order == "asc" else ids[::-1]
    if after is not None:
        if after not in ordered:
            raise InvalidRequestError(f"after names no item of this list: {after!r}")
        ordered = ordered[ordered.index(after) + 1 :]
    return ordered[:limit], len(ordered) > limit


def item_list(page: list[Item], has_more: bool) -> ItemList:
    return ItemList(
        data=page,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
        has_more=has_more,
    )


def page_of(items: list[Item], *, after: str | None, limit: int, order: str) -> ItemList:
    """One page of ``items`` (oldest first as given) in ``order``, after the item ``after``."""
    by_id = {item.id: item for item in items}
    ids, has_more = page_window(list(by_id), after=after, limit=limit, order=order)
    return item_list([by_id[i] for i in ids], has_more)
