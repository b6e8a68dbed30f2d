"""0004: a session's token history moves out of its record, into its own key.

Layout 2 kept the whole ``SessionRecord``, token ids included, under
``p:session:{<sid>}``, so listing a tenant's sessions read every token of
every listed conversation. Layout 4 keeps a ``SessionSummary`` there (the
record without its token ids, with their count) and the token history under
``p:session:{<sid>}:tokens``.

Idempotent: a record is converted only while it still carries ``token_ids``;
the token key and the summary are written in one MULTI (same hash tag), so a
crash leaves each session either in the old shape or in the new one. A key's
remaining idle TTL carries over to both.
"""

from __future__ import annotations

import msgspec
import redis.asyncio as aredis
from redis.exceptions import WatchError

from migrations.keyspace import KeyNames

VERSION = 4
NAME = "session_tokens_key"


class _Layout2Session(msgspec.Struct, kw_only=True):
    # A layout-4 summary decodes here too, with token_ids None: nothing to move.
    id: str
    tenant_id: str
    system_prompt_id: str | None
    metadata: dict[str, str]
    created_at: float
    updated_at: float
    num_messages: int = 0
    token_ids: list[int] | None = None


class _Layout4Summary(msgspec.Struct, kw_only=True):
    # The session summary of layout 4, field for field (chatsvc.store.records.SessionSummary
    # as this migration wrote it): encoded as a map in this order.
    id: str
    tenant_id: str
    system_prompt_id: str | None
    metadata: dict[str, str]
    created_at: float
    updated_at: float
    num_messages: int = 0
    num_tokens: int = 0


_decoder = msgspec.msgpack.Decoder(_Layout2Session)
_encoder = msgspec.msgpack.Encoder()


async def _convert(client: aredis.Redis, keys: KeyNames, summary_key: str) -> None:
    while True:
        async with client.pipeline(transaction=True) as pipe:
            # WATCH: a replica still on layout 2 may rewrite the record meanwhile.
            await pipe.watch(summary_key)
            raw = await pipe.get(summary_key)
            if raw is None:
                return  # expired or deleted since the scan saw it
            old = _decoder.decode(raw)
            if old.token_ids is None:
                return
            ttl_ms = await pipe.pttl(summary_key)
            tokens_key = keys.session_tokens(old.id)
            pipe.multi()
            # The token history is a msgpack array of ints.
            pipe.set(tokens_key, _encoder.encode(old.token_ids))
            # KEEPTTL: the summary keeps the idle expiry it had.
            pipe.set(summary_key, _encoder.encode(_summary(old)), keepttl=True)
            if ttl_ms > 0:
                pipe.pexpire(tokens_key, ttl_ms)
            try:
                await pipe.execute()
                return
            except WatchError:
                continue


def _summary(old: _Layout2Session) -> _Layout4Summary:
    return _Layout4Summary(
        id=old.id,
        tenant_id=old.tenant_id,
        system_prompt_id=old.system_prompt_id,
        metadata=old.metadata,
        created_at=old.created_at,
        updated_at=old.updated_at,
        num_messages=old.num_messages,
        num_tokens=len(old.token_ids or ()),
    )


async def up(client: aredis.Redis, keys: KeyNames) -> None:
    async for raw_key in client.scan_iter(match=keys.sessions_pattern(), _type="string"):
        await _convert(client, keys, raw_key.decode())
    await client.hset(keys.meta(), "layout", "4")
