"""Records kept in Redis: msgspec Structs, encoded as msgpack.

Structs encode as maps (not arrays), so adding a field with a default keeps
old records decodable; changes that need data rewritten go into a numbered
migration under ``migrations/``, and ``SCHEMA_VERSION`` names the newest one.
"""

from __future__ import annotations

import time
from typing import TypeVar

import msgspec

# The keyspace layout these records and ``chatsvc.store.keys`` describe. It equals
# the number of the newest migration; the runner stores it under the version key.
SCHEMA_VERSION = 6


def now() -> float:
    """Wall-clock seconds since the epoch; records compare times across replicas."""
    return time.time()


class TenantRecord(msgspec.Struct, kw_only=True):
    """A tenant, identified by its unique ``name`` (the name in ``CHATSVC_API_KEYS``).

    ``cache_salt`` is secret: it keys the tenant's private KV namespace. API keys
    are not part of a tenant: each replica admits the keys of its own settings.
    """

    id: str
    name: str
    cache_salt: bytes
    created_at: float
    # Written by schema versions 1-2 (hex sha256 of the key the tenant was created
    # with); kept so those records decode, never read.
    api_key_hash: str = ""


class SystemPromptRecord(msgspec.Struct, kw_only=True):
    """A system prompt: a tenant's private one, or a shared one the operator published.

    ``tenant_id`` is the owning tenant; None (with ``shared``) marks a prompt the
    operator published, usable by every tenant. A tenant never owns a shared prompt.
    """

    id: str
    tenant_id: str | None
    name: str
    text: str
    token_ids: list[int]
    shared: bool
    created_at: float


class Usage(msgspec.Struct, kw_only=True):
    """What producing an assistant message cost, as the engine reported it."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float | None = None


class MessageRecord(msgspec.Struct, kw_only=True):
    """One message of a session, with the exact token ids the model saw or produced.

    Since layout 5 a session's messages form a tree (``parent_id``; None at the top
    level) and each is stored once, however many branches pass through it.

    Token ids: the token history of a branch is its messages' ``token_ids`` end to
    end, except that a message with ``from_start`` holds the whole history up to and
    including itself (the chat template rendered the conversation again). A message
    written without a model run (a conversation item) has no token ids: the next
    turn's tokens cover its text.
    """

    role: str  # "system" | "user" | "assistant"
    text: str
    token_ids: list[int]
    created_at: float = msgspec.field(default_factory=now)
    usage: Usage | None = None
    # "" until the store assigns one (records of layouts 1-4 had none).
    id: str = ""
    parent_id: str | None = None
    from_start: bool = False


class SessionSummary(msgspec.Struct, kw_only=True):
    """A session without its token history: what ``p:session:{<sid>}`` holds and
    what listing returns. Its size does not grow with the conversation."""

    id: str
    tenant_id: str
    system_prompt_id: str | None
    metadata: dict[str, str]
    created_at: float
    updated_at: float
    num_messages: int = 0  # on the active branch
    num_tokens: int = 0
    # Layout 5: the last message of the active branch (None: no message yet), the
    # messages on every branch, a counter every write bumps, and which API made it.
    active_leaf: str | None = None
    num_nodes: int = 0
    version: int = 0
    kind: str = "session"  # "session" | "conversation" | "response"


class SessionRecord(msgspec.Struct, kw_only=True):
    """A conversation. ``token_ids`` is the whole conversation as last sent to or
    produced by the model, so the next prompt is these tokens plus the new turn's.

    Stored as two keys: the ``SessionSummary`` and the token history on its own
    (layout 4; before it, this whole record was the session key's value)."""

    id: str
    tenant_id: str
    system_prompt_id: str | None
    metadata: dict[str, str]
    created_at: float
    updated_at: float
    num_messages: int = 0
    token_ids: list[int] = msgspec.field(default_factory=list)
    active_leaf: str | None = None
    num_nodes: int = 0
    version: int = 0
    kind: str = "session"

    def summary(self) -> SessionSummary:
        """The record without its token ids (their count stays)."""
        return SessionSummary(
            **{f: getattr(self, f) for f in _SHARED_FIELDS}, num_tokens=len(self.token_ids)
        )

    @classmethod
    def from_summary(cls, summary: SessionSummary, token_ids: list[int]) -> SessionRecord:
        """The record a summary and its token history make."""
        return cls(**{f: getattr(summary, f) for f in _SHARED_FIELDS}, token_ids=token_ids)


# Every field a summary and a record have in common (all but the tokens / their count).
_SHARED_FIELDS = tuple(f for f in SessionSummary.__struct_fields__ if f != "num_tokens")


class ResponseRecord(msgspec.Struct, kw_only=True):
    """A stored response of the Responses API: one turn of a session, named by its id.

    The messages themselves live in the session's tree (stored once): ``input_ids``
    are the turn's input messages, ``output_id`` its answer, whose usage the message
    carries. Everything else is what the response object echoes back.
    """

    id: str
    session_id: str
    created_at: float
    completed_at: float
    model: str
    status: str  # "completed" | "incomplete"
    incomplete_reason: str | None = None
    input_ids: list[str]
    output_id: str
    instructions: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    previous_response_id: str | None = None
    conversation_id: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    max_output_tokens: int | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    user: str | None = None


ROLES = frozenset({"system", "user", "assistant"})
# Which API made a session (all are sessions; conversations and response chains too).
SESSION_KINDS = frozenset({"session", "conversation", "response"})

_encoder = msgspec.msgpack.Encoder()
_decoders = {
    cls: msgspec.msgpack.Decoder(cls)
    for cls in (
        TenantRecord,
        SystemPromptRecord,
        MessageRecord,
        SessionRecord,
        SessionSummary,
        ResponseRecord,
    )
}
_tokens_decoder = msgspec.msgpack.Decoder(list[int])


def encode(record: msgspec.Struct) -> bytes:
    """Encode a record as msgpack."""
    return _encoder.encode(record)


T = TypeVar("T")


def decode(cls: type[T], data: bytes) -> T:
    """Decode msgpack ``data`` as ``cls``; raises ``msgspec.ValidationError`` on a bad shape."""
    return _decoders[cls].decode(data)


def encode_tokens(token_ids: list[int]) -> bytes:
    """A token history as stored under ``p:session:{<sid>}:tokens`` (a msgpack array)."""
    return _encoder.encode(token_ids)


def decode_tokens(data: bytes) -> list[int]:
    """The token ids ``encode_tokens`` wrote; ``msgspec.ValidationError`` on a bad shape."""
    return _tokens_decoder.decode(data)
