"""Migration 0003 on data as layout 2 wrote it: tenants claim their names, key records
go, and shared prompts a tenant owned become its private ones."""

from __future__ import annotations

import msgspec
import pytest

from chatsvc.store import Store
from chatsvc.store.keys import Keys
from chatsvc.store.records import (
    SCHEMA_VERSION,
    SessionRecord,
    SystemPromptRecord,
    TenantRecord,
    encode,
)
from migrations import m0003_tenant_names_and_operator_prompts as m0003

pytestmark = pytest.mark.anyio


def _tenant(tid: str, name: str, created_at: float) -> TenantRecord:
    return TenantRecord(
        id=tid, name=name, api_key_hash=tid * 8, cache_salt=tid.encode() * 8, created_at=created_at
    )


def _prompt(pid: str, tenant_id: str, shared: bool) -> SystemPromptRecord:
    return SystemPromptRecord(
        id=pid,
        tenant_id=tenant_id,
        name=pid,
        text=f"Prompt {pid}.",
        token_ids=[1, 2],
        shared=shared,
        created_at=1.0,
    )


async def _write_layout_2(raw, keys: Keys) -> None:
    # acme's key was rotated under layout 2: the new key made a second "acme".
    for tenant in (
        _tenant("t1", "acme", 1.0),
        _tenant("t2", "acme", 2.0),
        _tenant("t3", "globex", 1.5),
    ):
        await raw.set(keys.tenant(tenant.id), encode(tenant))
        await raw.set(f"{keys.prefix}:apikey:{tenant.id * 16}", tenant.id)
    # t1 had shared a prompt (any tenant could); t3 started a session on it.
    for prompt in (_prompt("p1", "t1", True), _prompt("p3", "t3", False)):
        await raw.set(keys.prompt(prompt.id), encode(prompt))
        await raw.sadd(keys.tenant_prompts(prompt.tenant_id), prompt.id)
    await raw.sadd(keys.shared_prompts(), "p1", "gone")
    session = SessionRecord(
        id="s1",
        tenant_id="t3",
        system_prompt_id="p1",
        metadata={},
        created_at=1.0,
        updated_at=1.0,
        num_messages=1,
        token_ids=[1, 2],
    )
    await raw.set(keys.session("s1"), encode(session))
    await raw.zadd(keys.tenant_sessions("t3"), {"s1": 1.0})
    await raw.set(keys.schema_version(), 2)


async def test_layout_2_tenants_and_prompts_are_upgraded(redis_server, prefix, raw):
    keys = Keys(prefix)
    await _write_layout_2(raw, keys)
    store = await Store.connect(redis_server.url, prefix=prefix)
    try:
        # Every later migration ran too: the keyspace is at the newest layout.
        assert await raw.hget(keys.meta(), "layout") == str(SCHEMA_VERSION).encode()
        # Each name has one tenant; the rotated name keeps its newest tenant.
        assert (await store.tenants.by_name("acme")).id == "t2"
        assert (await store.tenants.by_name("globex")).id == "t3"
        assert (await store.tenants.ensure("acme")).id == "t2"
        assert [k async for k in raw.scan_iter(match=f"{prefix}:apikey:*")] == []

        # The tenant-shared prompt is now t1's private one, and nobody else's.
        p1 = await store.prompts.get("t1", "p1")
        assert p1 is not None and not p1.shared
        # Every other field is kept, in the bytes the store itself writes.
        unshared = msgspec.structs.replace(_prompt("p1", "t1", True), shared=False)
        assert p1 == unshared
        assert await raw.get(keys.prompt("p1")) == encode(unshared)
        assert await store.prompts.get("t3", "p1") is None
        assert await store.prompts.all_shared() == []
        assert [p.id for p in await store.prompts.visible("t3")] == ["p3"]
        assert await raw.smembers(keys.shared_prompts()) == set()
        # t3's session on it is intact and still its own.
        assert (await store.sessions.get("t3", "s1")).system_prompt_id == "p1"
    finally:
        await store.close()


async def test_migration_0003_is_idempotent(redis_server, prefix, raw):
    keys = Keys(prefix)
    await _write_layout_2(raw, keys)
    operator = SystemPromptRecord(
        id="p9", tenant_id=None, name="p9", text="All.", token_ids=[3], shared=True, created_at=2.0
    )
    await raw.set(keys.prompt("p9"), encode(operator))
    await raw.sadd(keys.shared_prompts(), "p9")
    await m0003.up(raw, keys)
    once = {k: await raw.dump(k) async for k in raw.scan_iter(match=f"{prefix}:*")}
    await m0003.up(raw, keys)
    again = {k: await raw.dump(k) async for k in raw.scan_iter(match=f"{prefix}:*")}
    assert again == once
    # An operator's shared prompt stays shared.
    assert await raw.smembers(keys.shared_prompts()) == {b"p9"}
    assert await raw.hgetall(keys.tenant_names()) == {b"acme": b"t2", b"globex": b"t3"}
