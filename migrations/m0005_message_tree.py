"""0005: a session's message list becomes a tree of messages with an active branch.

Layouts 1-4 kept a session's messages as one list, ``p:session:{<sid>}:messages``.
Layout 5 keeps each message once in ``p:session:{<sid>}:nodes`` (id -> record,
with its parent's id), the child lists in ``:children``, and the active branch
in ``:path``; the summary names the active branch's last message. An old list
becomes a single branch: each message gets an id and the one before it as parent.

Token ids: a user message whose ids were the whole re-rendered conversation
(``ChatFormat.extend`` could not extend the history) is marked ``from_start``,
found by comparing against the session's token history; every other message
keeps continuing the one before it.

Idempotent: a session is converted only while its old list exists; the new
keys, the summary and the list's removal are one MULTI (same hash tag, WATCHed),
so a crash leaves each session in the old shape or in the new one. A key's
remaining idle TTL carries over.
"""

from __future__ import annotations

import secrets

import msgspec
import redis.asyncio as aredis
from redis.exceptions import WatchError

from migrations.keyspace import KeyNames

VERSION = 5
NAME = "message_tree"

# The child lists' key for the top level, and the message ids' prefix, of layout 5.
_ROOT = "root"
_MESSAGE_ID_PREFIX = "msg_"


class _Message(msgspec.Struct, kw_only=True):
    # A message record of layouts 1-4 (role, text, token_ids, created_at, usage) and the
    # fields layout 5 adds to it: encoded as a map in this order.
    role: str
    text: str
    token_ids: list[int]
    created_at: float
    usage: dict[str, object] | None = None
    id: str = ""
    parent_id: str | None = None
    from_start: bool = False


class _Summary(msgspec.Struct, kw_only=True):
    # The session summary of layout 4 and the fields layout 5 adds (active_leaf,
    # num_nodes, version, kind): encoded as a map in this order.
    id: str
    tenant_id: str
    system_prompt_id: str | None
    metadata: dict[str, str]
    created_at: float
    updated_at: float
    num_messages: int = 0
    num_tokens: int = 0
    active_leaf: str | None = None
    num_nodes: int = 0
    version: int = 0
    kind: str = "session"


_encoder = msgspec.msgpack.Encoder()
_summary_decoder = msgspec.msgpack.Decoder(_Summary)
_message_decoder = msgspec.msgpack.Decoder(_Message)
_tokens_decoder = msgspec.msgpack.Decoder(list[int])


def mark_restarts(messages: list[_Message], history: list[int]) -> list[_Message]:
    """``messages`` with ``from_start`` set where their ids start the history over."""
    marked: list[_Message] = []
    tokens: list[int] = []
    for message in messages:
        extended = [*tokens, *message.token_ids]
        restarts = (
            tokens
            and history[: len(extended)] != extended
            and history[: len(message.token_ids)] == message.token_ids
        )
        if restarts:
            message = msgspec.structs.replace(message, from_start=True)
            tokens = list(message.token_ids)
        else:
            tokens = extended
        marked.append(message)
    return marked


def _chain(messages: list[_Message]) -> list[_Message]:
    """The list as one branch from the top: each message gets an id, and the one
    before it as its parent."""
    chain: list[_Message] = []
    parent_id = None
    for message in messages:
        message_id = message.id or _MESSAGE_ID_PREFIX + secrets.token_hex(8)
        chain.append(msgspec.structs.replace(message, id=message_id, parent_id=parent_id))
        parent_id = message_id
    return chain


def _children(chain: list[_Message]) -> dict[str, str]:
    # A children field holds comma-separated ids; a single chain has one child each.
    fields = {_ROOT: chain[0].id}
    for parent, child in zip(chain, chain[1:], strict=False):
        fields[parent.id] = child.id
    return fields


async def _convert(client: aredis.Redis, keys: KeyNames, summary_key: str) -> None:
    while True:
        async with client.pipeline(transaction=True) as pipe:
            # WATCH: a replica still on layout 4 may append a turn meanwhile.
            await pipe.watch(summary_key)
            raw = await pipe.get(summary_key)
            if raw is None:
                return  # expired or deleted since the scan saw it
            summary = _summary_decoder.decode(raw)
            sid = summary.id
            list_key = keys.session_messages(sid)
            await pipe.watch(list_key, keys.session_tokens(sid))
            raw_messages = await pipe.lrange(list_key, 0, -1)
            if not raw_messages:
                return  # converted already, or a session without messages
            raw_tokens = await pipe.get(keys.session_tokens(sid))
            history = _tokens_decoder.decode(raw_tokens) if raw_tokens else []
            ttl_ms = await pipe.pttl(summary_key)
            old = [_message_decoder.decode(m) for m in raw_messages]
            chain = _chain(mark_restarts(old, history))
            converted = msgspec.structs.replace(
                summary,
                active_leaf=chain[-1].id,
                num_messages=len(chain),
                num_nodes=len(chain),
            )
            new_keys = [keys.session_nodes(sid), keys.session_children(sid), keys.session_path(sid)]
            pipe.multi()
            pipe.hset(new_keys[0], mapping={m.id: _encoder.encode(m) for m in chain})
            pipe.hset(new_keys[1], mapping=_children(chain))
            pipe.rpush(new_keys[2], *(m.id for m in chain))
            # KEEPTTL: the summary keeps the idle expiry it had.
            pipe.set(summary_key, _encoder.encode(converted), keepttl=True)
            pipe.delete(list_key)
            if ttl_ms > 0:
                for key in new_keys:
                    pipe.pexpire(key, ttl_ms)
            try:
                await pipe.execute()
                return
            except WatchError:
                continue


async def up(client: aredis.Redis, keys: KeyNames) -> None:
    async for raw_key in client.scan_iter(match=keys.sessions_pattern(), _type="string"):
        await _convert(client, keys, raw_key.decode())
    await client.hset(keys.meta(), "layout", "5")
