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

import msgspec
import redis.asyncio as aredis
from redis.exceptions import WatchError

from chatsvc.store.keys import Keys
from chatsvc.store.records import MessageRecord, SessionSummary, decode, decode_tokens, encode
from chatsvc.store.tree import ROOT, chain_children, link_chain
from migrations.runner import Migration


def mark_restarts(messages: list[MessageRecord], history: list[int]) -> list[MessageRecord]:
    """``messages`` with ``from_start`` set where their ids start the history over."""
    marked: list[MessageRecord] = []
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


async def _convert(client: aredis.Redis, keys: Keys, summary_key: str) -> None:
    while True:
        async with client.pipeline(transaction=True) as pipe:
            # WATCH: a replica still on layout 4 may append a turn meanwhile.
            await pipe.watch(summary_key)
            raw = await pipe.get(summary_key)
            if raw is None:
                return  # expired or deleted since the scan saw it
            summary = decode(SessionSummary, raw)
            sid = summary.id
            list_key = keys.session_messages(sid)
            await pipe.watch(list_key, keys.session_tokens(sid))
            raw_messages = await pipe.lrange(list_key, 0, -1)
            if not raw_messages:
                return  # converted already, or a session without messages
            raw_tokens = await pipe.get(keys.session_tokens(sid))
            history = decode_tokens(raw_tokens) if raw_tokens else []
            ttl_ms = await pipe.pttl(summary_key)
            old = [decode(MessageRecord, m) for m in raw_messages]
            chain = link_chain(mark_restarts(old, history), parent_id=None)
            converted = msgspec.structs.replace(
                summary,
                active_leaf=chain[-1].id,
                num_messages=len(chain),
                num_nodes=len(chain),
            )
            new_keys = [keys.session_nodes(sid), keys.session_children(sid), keys.session_path(sid)]
            pipe.multi()
            pipe.hset(new_keys[0], mapping={m.id: encode(m) for m in chain})
            pipe.hset(new_keys[1], mapping=chain_children(chain, parent_key=ROOT, existing=[]))
            pipe.rpush(new_keys[2], *(m.id for m in chain))
            # KEEPTTL: the summary keeps the idle expiry it had.
            pipe.set(summary_key, encode(converted), keepttl=True)
            pipe.delete(list_key)
            if ttl_ms > 0:
                for key in new_keys:
                    pipe.pexpire(key, ttl_ms)
            try:
                await pipe.execute()
                return
            except WatchError:
                continue


async def up(client: aredis.Redis, keys: Keys) -> None:
    async for raw_key in client.scan_iter(match=keys.sessions_pattern(), _type="string"):
        await _convert(client, keys, raw_key.decode())
    await client.hset(keys.meta(), "layout", "5")


MIGRATION = Migration(5, "message_tree", up)
