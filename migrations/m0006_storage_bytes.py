"""0006: each tenant's stored bytes, per session and in sum, for the storage quotas.

Layout 6 keeps ``p:tenant:<tid>:bytes``: session id -> the bytes its records
take (its token history and the values of its ``nodes`` and ``responses``
hashes), and ``*total`` -> their sum. Every write keeps both exact from then
on; this migration measures the sessions written before.

Idempotent: each session's figure is measured and set in one script, which
moves the total by the difference to what the field held, so a run
interrupted half way and run again ends with the same counters.
"""

from __future__ import annotations

import msgspec
import redis.asyncio as aredis

from migrations.keyspace import KeyNames

VERSION = 6
NAME = "storage_bytes"

# The sum's field of layout 6 (ids match [A-Za-z0-9_-], so no session id is it).
_TOTAL = "*total"

# KEYS: summary, tokens, nodes, responses, the tenant's bytes hash. ARGV: session id.
# HSTRLEN per field rather than HVALS: the values are measured, never copied.
_MEASURE = f"""
if redis.call('exists', KEYS[1]) == 0 then
    return 0
end
local size = redis.call('strlen', KEYS[2])
for _, key in ipairs({{KEYS[3], KEYS[4]}}) do
    for _, field in ipairs(redis.call('hkeys', key)) do
        size = size + redis.call('hstrlen', key, field)
    end
end
local old = tonumber(redis.call('hget', KEYS[5], ARGV[1]) or '0')
redis.call('hset', KEYS[5], ARGV[1], size)
redis.call('hincrby', KEYS[5], '{_TOTAL}', size - old)
return size
"""


class _Owner(msgspec.Struct):
    # The two fields of a layout-5 session summary this migration needs.
    id: str
    tenant_id: str


_decoder = msgspec.msgpack.Decoder(_Owner)


async def up(client: aredis.Redis, keys: KeyNames) -> None:
    measure = client.register_script(_MEASURE)
    async for raw_key in client.scan_iter(match=keys.sessions_pattern(), _type="string"):
        raw = await client.get(raw_key)
        if raw is None:
            continue  # expired or deleted since the scan saw it
        owner = _decoder.decode(raw)
        await measure(
            keys=[
                raw_key.decode(),
                keys.session_tokens(owner.id),
                keys.session_nodes(owner.id),
                keys.session_responses(owner.id),
                keys.tenant_bytes(owner.tenant_id),
            ],
            args=[owner.id],
        )
    await client.hset(keys.meta(), "layout", "6")
