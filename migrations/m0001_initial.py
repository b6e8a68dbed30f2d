"""0001: the first keyspace layout.

Layout 1 keeps each tenant's session ids in a plain SET (see 0002 for the
change). Nothing exists before it, so the only thing to write is the meta hash
that records when this keyspace was born; HSETNX keeps a re-run from
overwriting it.
"""

from __future__ import annotations

import time

import redis.asyncio as aredis

from migrations.keyspace import KeyNames

VERSION = 1
NAME = "initial"


async def up(client: aredis.Redis, keys: KeyNames) -> None:
    await client.hsetnx(keys.meta(), "created_at", repr(time.time()))
    await client.hset(keys.meta(), "layout", "1")
