"""0003: tenants are named identities, keys leave Redis, and only the operator shares prompts.

Layout 2 found a tenant by the sha256 of its API key (``p:apikey:<hash>``), so a
rotated key made a new tenant and a removed key kept working; any tenant could
mark its own prompts ``shared``. Layout 3:

- ``p:tenants`` maps each tenant name to its id. Every existing tenant claims
  its name; where key rotation had already split a name into several tenants,
  the newest one keeps it (the one the last configured key opened).
- ``p:apikey:*`` records are deleted: replicas admit the keys of their own
  settings, and a key record in Redis must not let anyone in.
- Shared prompts a tenant owned become that tenant's private prompts (out of
  ``p:prompts:shared``, ``shared`` false). Sessions started on them keep their
  own copy of the text and tokens; they no longer share KV across tenants.

Idempotent: names are claimed with HSETNX, prompts already private are left
alone, and deleting absent key records is a no-op.
"""

from __future__ import annotations

import msgspec
import redis.asyncio as aredis

from migrations.keyspace import KeyNames

VERSION = 3
NAME = "tenant_names_and_operator_prompts"


class _Tenant(msgspec.Struct):
    # What this migration reads of a layout-2 tenant record.
    id: str
    name: str
    created_at: float


class _Prompt(msgspec.Struct):
    # What this migration reads of a layout-2 system prompt record.
    tenant_id: str | None


_tenant_decoder = msgspec.msgpack.Decoder(_Tenant)
_prompt_decoder = msgspec.msgpack.Decoder(_Prompt)


async def _claim_names(client: aredis.Redis, keys: KeyNames) -> None:
    newest: dict[str, _Tenant] = {}
    record_prefix = keys.tenant("")
    async for raw_key in client.scan_iter(match=keys.tenant_records_pattern(), _type="string"):
        if ":" in raw_key.decode()[len(record_prefix) :]:
            continue  # a per-tenant key such as tenant:<tid>:..., not a record
        raw = await client.get(raw_key)
        if raw is None:
            continue
        tenant = _tenant_decoder.decode(raw)
        held = newest.get(tenant.name)
        if held is None or (tenant.created_at, tenant.id) > (held.created_at, held.id):
            newest[tenant.name] = tenant
    for name, tenant in sorted(newest.items()):
        await client.hsetnx(keys.tenant_names(), name, tenant.id)


async def _drop_key_records(client: aredis.Redis, keys: KeyNames) -> None:
    batch: list[bytes] = []
    async for raw_key in client.scan_iter(match=keys.legacy_api_keys_pattern()):
        batch.append(raw_key)
        if len(batch) >= 500:
            await client.delete(*batch)
            batch = []
    if batch:
        await client.delete(*batch)


async def _unshare_tenant_prompts(client: aredis.Redis, keys: KeyNames) -> None:
    for raw_id in await client.smembers(keys.shared_prompts()):
        prompt_id = raw_id.decode()
        raw = await client.get(keys.prompt(prompt_id))
        if raw is None:
            await client.srem(keys.shared_prompts(), prompt_id)
            continue
        prompt = _prompt_decoder.decode(raw)
        if prompt.tenant_id is None:
            continue  # published by the operator: stays shared
        # Rewritten as a plain map so every field of the record survives, in its order.
        private = {**msgspec.msgpack.decode(raw), "shared": False}
        async with client.pipeline(transaction=True) as pipe:
            pipe.set(keys.prompt(prompt_id), msgspec.msgpack.encode(private))
            pipe.sadd(keys.tenant_prompts(prompt.tenant_id), prompt_id)
            pipe.srem(keys.shared_prompts(), prompt_id)
            await pipe.execute()


async def up(client: aredis.Redis, keys: KeyNames) -> None:
    await _claim_names(client, keys)
    await _drop_key_records(client, keys)
    await _unshare_tenant_prompts(client, keys)
    await client.hset(keys.meta(), "layout", "3")
