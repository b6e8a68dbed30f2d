"""Bodies of ``POST /v1/completions`` (OpenAI's legacy completions, as vLLM serves them)."""

from __future__ import annotations

from typing import Literal

import msgspec

from chatsvc.api.openai.sampling_fields import SamplingFields
from chatsvc.api.openai.schemas import CompletionUsage


class CompletionRequest(SamplingFields, kw_only=True):
    """``prompt``: a string, a list of strings, a list of token ids, or a list of such
    lists; each prompt is its own completion (choices ``prompt_index * n + i``)."""

    model: str
    prompt: str | list[str | int | list[int]]
    # OpenAI's default for this endpoint (and vLLM's).
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None
    # vLLM's extension: scores of the prompt's tokens, on each choice.
    prompt_logprobs: int | None = None
    # Insertion (text after the completion): not supported, refused with a 400.
    suffix: str | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, kw_only=True):
    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # The server sends a prompt's entries as one msgspec.Raw of this list, encoded once
    # and shared by the prompt's n choices (completion_output); the JSON is the same.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(msgspec.Struct, kw_only=True):
    """The answer, and (with ``stream``) each chunk: the same object, ``usage`` null
    on chunks but the last one (with ``stream_options.include_usage``)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None
