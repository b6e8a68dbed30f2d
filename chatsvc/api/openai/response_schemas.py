"""Bodies of the Responses and Conversations APIs, in the field names the openai SDK uses.

Requests forbid unknown fields. Fields the SDK may send that would change what
the model does here and that this server does not implement (tools, reasoning,
background runs, structured output, logprobs, ...) are declared so they can be
accepted at their neutral value and refused with a 400 naming them otherwise
(``refused_fields``); nothing is silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from chatsvc.api.openai.schemas import refused_tools


class InputText(msgspec.Struct, forbid_unknown_fields=True, tag_field="type", tag="input_text"):
    text: str


class InputOutputText(
    msgspec.Struct, forbid_unknown_fields=True, tag_field="type", tag="output_text", kw_only=True
):
    """An earlier answer sent back as input (e.g. ``previous.output`` replayed):
    its annotations and logprobs describe it and change nothing here."""

    text: str
    annotations: list[dict[str, Any]] = msgspec.field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class InputMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A message item of ``input`` (and of conversation items). ``id`` / ``status`` /
    ``phase`` come with replayed output items and are not used."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | InputOutputText]
    type: Literal["message"] = "message"
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def stored_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class ConversationRef(msgspec.Struct, forbid_unknown_fields=True):
    id: str


class TextFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"] = "text"


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: TextFormat | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_obfuscation: bool = False


class CreateResponse(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/responses``. ``input``: a string (one user message) or message items."""

    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: str | ConversationRef | None = None
    store: bool | None = None  # None: true, as in OpenAI's API
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # Accepted at their neutral value only (see refused_fields).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    top_logprobs: int | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory"] | None = None

    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation

    def refused_fields(self) -> list[str]:
        """The fields given with a value that asks for something not done here."""
        refused = refused_tools(self.tools, self.tool_choice)
        if self.reasoning:
            refused.append("reasoning (the model does not reason in separate tokens)")
        if self.background:
            refused.append("background (responses run in the request)")
        if self.include:
            refused.append(f"include ({', '.join(map(repr, self.include))} is not produced)")
        if self.top_logprobs:
            refused.append("top_logprobs (logprobs are not produced)")
        if self.prompt is not None:
            refused.append("prompt (no stored prompt templates)")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            refused.append("stream_options.include_obfuscation (streams carry no padding)")
        return refused


# -- what the API answers -------------------------------------------------------------


class OutputText(msgspec.Struct, tag_field="type", tag="output_text", kw_only=True):
    text: str
    annotations: list[dict[str, Any]] = msgspec.field(default_factory=list)
    logprobs: list[dict[str, Any]] = msgspec.field(default_factory=list)


class InputTextView(msgspec.Struct, tag_field="type", tag="input_text"):
    text: str


class Item(msgspec.Struct, kw_only=True):
    """A message: an output item of a response, an input item, a conversation item."""

    id: str
    role: Literal["user", "assistant", "system", "developer"]
    content: list[InputTextView | OutputText]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    type: Literal["message"] = "message"


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int
    # Prompt tokens this response computed (their KV enters the cache block by block).
    cache_write_tokens: int


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: Literal["max_output_tokens"]


class ConversationView(msgspec.Struct, kw_only=True):
    id: str


class TextConfigView(msgspec.Struct, kw_only=True):
    format: TextFormat = msgspec.field(default_factory=TextFormat)


class ResponseObject(msgspec.Struct, kw_only=True):
    """A response, as ``client.responses.create`` / ``retrieve`` parse it."""

    id: str
    created_at: int
    model: str
    status: Literal["completed", "failed", "in_progress", "incomplete"]
    output: list[Item]
    object: Literal["response"] = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    previous_response_id: str | None = None
    conversation: ConversationView | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    usage: ResponseUsage | None = None
    store: bool = True
    completed_at: int | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    user: str | None = None
    background: bool = False
    parallel_tool_calls: bool = True
    tool_choice: Literal["auto", "none"] = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    text: TextConfigView = msgspec.field(default_factory=TextConfigView)
    truncation: Literal["disabled"] = "disabled"
    service_tier: Literal["default"] = "default"


class ResponseDeleted(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class ItemList(msgspec.Struct, kw_only=True):
    """A page of items: ``first_id`` / ``last_id`` frame it; pass ``last_id`` as ``after``."""

    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


# -- conversations ----------------------------------------------------------------------


class CreateConversation(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    items: list[InputMessage] | None = None
    metadata: dict[str, str] | None = None


class UpdateConversation(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    metadata: dict[str, str] | None


class AddItems(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    items: list[InputMessage]


class ConversationObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    metadata: dict[str, str]
    object: Literal["conversation"] = "conversation"


class ConversationDeleted(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: bool = True
