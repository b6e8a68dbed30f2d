"""Bodies of the OpenAI-compatible endpoints, in the field names the openai SDK uses.

Fields the SDK may send but this server does not implement are accepted only
at their neutral value (e.g. ``presence_penalty=0``) so nothing is silently
ignored; anything unknown is rejected.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    messages: list[ChatMessage]
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    # Not in OpenAI's API but common in compatible servers (vLLM, SGLang).
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    # Caller ids (chatsvc.api.caller_ids): logged as hashes; the cache key comes back
    # in the X-Prompt-Cache-Key header, for a load balancer's affinity.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Extension (the openai SDK sends it with extra_body): a stored system prompt by
    # id, whose text becomes the leading system message. Only a shared prompt named
    # here puts the conversation's head in the public cache namespace.
    system_prompt_id: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: None = None


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
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    usage: CompletionUsage | None = None


class Model(msgspec.Struct, kw_only=True):
    id: str
    created: int
    owned_by: str = "chatsvc"
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct, kw_only=True):
    data: list[Model]
    object: Literal["list"] = "list"
