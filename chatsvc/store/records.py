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
SCHEMA_VERSION = 4


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
    """One message of a session, with the exact token ids the model saw or produced."""

    role: str  # "system" | "user" | "assistant"
    text: str
    token_ids: list[int]
    created_at: float = msgspec.field(default_factory=now)
    usage: Usage | None = None


class SessionSummary(msgspec.Struct, kw_only=True):
    """A session without its token history: what ``p:session:{<sid>}`` holds and
    what listing returns. Its size does not grow with the conversation."""

    id: str
    tenant_id: str
    system_prompt_id: str | None
    metadata: dict[str, str]
    created_at: float
    updated_at: float
    num_messages: int = 0
    num_tokens: int = 0


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

    def summary(self) -> SessionSummary:
        """The record without its token ids (their count stays)."""
        return SessionSummary(
            id=self.id,
            tenant_id=self.tenant_id,
            system_prompt_id=self.system_prompt_id,
            metadata=self.metadata,
            created_at=self.created_at,
            updated_at=self.updated_at,
            num_messages=self.num_messages,
            num_tokens=len(self.token_ids),
        )

    @classmethod
    def from_summary(cls, summary: SessionSummary, token_ids: list[int]) -> SessionRecord:
        """The record a summary and its token history make."""
        return cls(
            id=summary.id,
            tenant_id=summary.tenant_id,
            system_prompt_id=summary.system_prompt_id,
            metadata=summary.metadata,
            created_at=summary.created_at,
            updated_at=summary.updated_at,
            num_messages=summary.num_messages,
            token_ids=token_ids,
        )


ROLES = frozenset({"system", "user", "assistant"})

_encoder = msgspec.msgpack.Encoder()
_decoders = {
    cls: msgspec.msgpack.Decoder(cls)
    for cls in (TenantRecord, SystemPromptRecord, MessageRecord, SessionRecord, SessionSummary)
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
