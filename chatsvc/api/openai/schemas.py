"""Bodies of the OpenAI-compatible chat endpoint and /v1/models, in the openai SDK's names.

Anything this server does not implement is rejected, so nothing is silently
ignored: a field nobody sends here is unknown (400); an OpenAI field that clients
send by habit (``tools: []``, ``response_format: {"type": "text"}``, an answer
replayed with ``refusal: null``) is declared, accepted at its neutral value and
refused by name otherwise (``refused_fields``), as on the Responses API. The
sampling fields shared with /v1/completions are in ``sampling_fields``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from chatsvc.api.openai.sampling_fields import SamplingFields


def refused_tools(tools: list | None, tool_choice: str | dict | None) -> list[str]:
    """The refusals of a request's tool fields (chat completions and Responses alike):
    no tools run here, so only none and a choice that asks for none are accepted."""
    refused = []
    if tools:
        refused.append("tools (this server runs no tools)")
    if tool_choice not in (None, "none", "auto"):
        refused.append("tool_choice (no tools: only 'none' or 'auto')")
    return refused


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None
    # What the SDK's ChatCompletionMessage holds besides role and content: an answer
    # appended to the history as ``message.model_dump()`` sends them back, null.
    # ``annotations`` describe an earlier answer and change nothing; the others are
    # accepted empty only (see refused_fields).
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def refused_fields(self) -> list[str]:
        refused = []
        if self.refusal is not None:
            refused.append("refusal (only null: send a refused turn's text as content)")
        if self.audio is not None:
            refused.append("audio (the model takes text only)")
        if self.tool_calls:
            refused.append("tool_calls (this server runs no tools)")
        if self.function_call is not None:
            refused.append("function_call (this server runs no tools)")
        return refused

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, str]:
        """The message as the chat template takes it (``developer`` is a system message)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class ChatCompletionRequest(SamplingFields, kw_only=True):
    model: str
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Caller ids (chatsvc.api.openai.caller_ids; ``user`` is a sampling field): logged as
    # hashes; the cache key comes back in the X-Prompt-Cache-Key header, for a load
    # balancer's affinity.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Extension (the openai SDK sends it with extra_body): a stored system prompt by
    # id, whose text becomes the leading system message. Only a shared prompt named
    # here puts the conversation's head in the public cache namespace.
    system_prompt_id: str | None = None
    # Extension (extra_body), as TensorRT-LLM and transformers name them: beam search
    # of this width (2-8); the n best beams are the choices, best first.
    beam_width: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    # Extensions (extra_body), vLLM's: the answer continues the final (assistant's)
    # message; or the prompt ends without the answer's turn opened (None: opened,
    # unless the final message is continued). See chat_completions.render_prompt.
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    # OpenAI fields accepted at their neutral value only (see refused_fields). Chat
    # completions are not stored here (``store: true`` is refused), so ``metadata`` is
    # checked and kept nowhere, as OpenAI does without ``store``.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_retention: Literal["in_memory"] | None = None

    def refused_fields(self) -> list[str]:
        """The fields given with a value that asks for something not done here."""
        refused = refused_tools(self.tools, self.tool_choice)
        if self.response_format is not None and self.response_format != {"type": "text"}:
            kind = self.response_format.get("type")
            refused.append(f"response_format ({kind!r}: only 'text'; no structured output)")
        if self.store:
            refused.append(
                "store (chat completions are not stored; the Responses API and "
                "/sessions keep conversations)"
            )
        if self.modalities is not None and self.modalities != ["text"]:
            refused.append("modalities (only ['text'])")
        return refused


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobView(msgspec.Struct, kw_only=True):
    """One output token: its text, log-probability, UTF-8 bytes, and the likeliest tokens."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprobView] | None
    refusal: None = None


class Choice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int


class CompletionUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None


class ChunkDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: CompletionUsage | None = None


class Model(msgspec.Struct, kw_only=True):
    """The served model. ``max_model_len`` (as vLLM reports it): the longest prompt +
    completion in tokens; ``kv_block_size``: tokens per KV cache block, the unit of
    prefix reuse (cached_tokens are multiples of it)."""

    id: str
    created: int
    max_model_len: int
    kv_block_size: int
    owned_by: str = "chatsvc"
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[Model]
    object: Literal["list"] = "list"
