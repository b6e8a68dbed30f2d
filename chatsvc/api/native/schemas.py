"""Request and response bodies of the native API (sessions, messages, system prompts).

Request bodies forbid unknown fields, so a misspelt option fails loudly
instead of being ignored.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class Request(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of request bodies."""


class CreateSystemPrompt(Request):
    """A tenant's private prompt. ``shared`` is accepted only as false (true: 403),
    since only the operator shares (``CreateSharedPrompt``)."""

    name: str
    text: str
    shared: bool = False


class CreateSharedPrompt(Request):
    """A prompt the operator publishes: every tenant can read it and use it, and its
    KV blocks are shared across tenants, so the text must hold nothing secret."""

    name: str
    text: str


class SystemPromptView(msgspec.Struct, kw_only=True):
    id: str
    name: str
    text: str
    shared: bool
    num_tokens: int
    created_at: float


class SystemPromptList(msgspec.Struct, kw_only=True):
    system_prompts: list[SystemPromptView]


class CreateSession(Request):
    """Either a stored system prompt by id or inline text; neither = the model's default."""

    system_prompt_id: str | None = None
    system_prompt: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


class SessionView(msgspec.Struct, kw_only=True):
    """A session's summary: never its messages or token ids (its size does not grow
    with the conversation), so listing stays cheap however long sessions get."""

    id: str
    system_prompt_id: str | None
    metadata: dict[str, str]
    num_messages: int
    num_tokens: int
    created_at: float
    updated_at: float


class SessionList(msgspec.Struct, kw_only=True):
    """One page, bounded by ``limit`` and by bytes; ``next_cursor`` None: the last page."""

    sessions: list[SessionView]
    next_cursor: str | None = None


class SamplingOptions(Request):
    """Sampling options shared by native messages; ranges are checked by SamplingParams.

    Unset (or null) sampling fields take the served model's defaults
    (``engine.sampling_defaults``). ``beam_width`` 2-8: beam search instead of sampling
    (its best beam is the answer), with transformers' ``length_penalty`` and
    ``early_stopping``; the sampling fields must then be left unset (or neutral)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    beam_width: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None


class PostMessage(SamplingOptions, kw_only=True):
    """A user message (``content``), or ``regenerate: true`` for a new answer.

    ``parent_message_id``: with ``content``, the message it follows (an earlier one
    branches off there, e.g. to edit a user message: name the message before it;
    ``"root"`` starts at the top); with ``regenerate``, the user message to answer
    again. Absent: the active branch's last message (its last user message for
    ``regenerate``).
    """

    content: str | None = None
    regenerate: bool = False
    parent_message_id: str | None = None
    stream: bool = False


class MessageView(msgspec.Struct, kw_only=True):
    """One message. ``sibling_ids``: every message at its place in the tree (its
    parent's children, itself included, oldest first): more than one = versions."""

    id: str
    role: Literal["system", "user", "assistant"]
    content: str
    created_at: float
    parent_id: str | None = None
    sibling_ids: list[str] = msgspec.field(default_factory=list)


class MessageList(msgspec.Struct, kw_only=True):
    """A branch of the session, root first (the active one unless ``leaf_id`` named
    another); ``continuations``: the ids of the messages that follow its last one.
    ``has_more``: the branch goes on past this page (pass the last id as ``after``)."""

    session_id: str
    messages: list[MessageView]
    continuations: list[str] = msgspec.field(default_factory=list)
    has_more: bool = False


class SwitchBranch(Request):
    """Make the branch through ``message_id`` active (from it, the newest message at
    every step down to the end)."""

    message_id: str


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # cached_tokens by the tier the KV came from: "device", "host", "disk" (sums to it).
    cached_tokens_by_tier: dict[str, int] = msgspec.field(default_factory=dict)


class Timings(msgspec.Struct, kw_only=True):
    ttft_s: float
    tpot_s: float
    latency_s: float


class TurnResult(msgspec.Struct, kw_only=True):
    """The answer to one user message; also the data of the final SSE ``done`` event."""

    session_id: str
    message: MessageView
    finish_reason: str
    usage: Usage
    timings: Timings
    # False when the chat template re-rendered earlier turns, so the new
    # prompt was not an extension of the stored tokens (cache reuse lost).
    prefix_reused: bool


class TextDelta(msgspec.Struct, kw_only=True):
    """Data of an SSE ``delta`` event: the next piece of the assistant's text."""

    text: str
