"""0002: each tenant's session index becomes a sorted set scored by updated_at.

Layout 1 kept ``tenant:<tid>:sessions`` as a SET, so listing had to load every
session to order it and could not paginate. Layout 2 scores each id by its
session's ``updated_at`` (newest first, keyset cursors). Ids whose session
record is gone (expired or deleted) are dropped on the way.

Idempotent: only SET-typed indexes are converted; the sorted set is built under
a scratch key and swapped in with one MULTI (DEL + RENAME), so a crash leaves
either the old SET or the finished sorted set, never a half-built index.
"""

from __future__ import annotations

import msgspec
import redis.asyncio as aredis

from migrations.keyspace import KeyNames

VERSION = 2
NAME = "session_index_zset"


class _Session(msgspec.Struct):
    # The one field this migration reads from a layout-1 session record.
    updated_at: float


_decoder = msgspec.msgpack.Decoder(_Session)


async def _convert(client: aredis.Redis, keys: KeyNames, index_key: str) -> None:
    scratch = f"{index_key}:m0002"
    await client.delete(scratch)
    session_ids = sorted(m.decode() for m in await client.smembers(index_key))
    raws = await client.mget([keys.session(sid) for sid in session_ids]) if session_ids else []
    scores = {
        sid: _decoder.decode(raw).updated_at
        for sid, raw in zip(session_ids, raws, strict=True)
        if raw is not None
    }
    async with client.pipeline(transaction=True) as pipe:
        if scores:
            pipe.zadd(scratch, scores)
            pipe.delete(index_key)
            pipe.rename(scratch, index_key)
        else:
            pipe.delete(index_key)
        await pipe.execute()


async def up(client: aredis.Redis, keys: KeyNames) -> None:
    async for raw_key in client.scan_iter(match=keys.tenant_sessions_pattern(), _type="set"):
        await _convert(client, keys, raw_key.decode())
    await client.hset(keys.meta(), "layout", "2")
