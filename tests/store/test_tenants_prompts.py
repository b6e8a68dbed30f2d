from __future__ import annotations

import hashlib

import pytest

from chatsvc.store import NotFoundError, Store

pytestmark = pytest.mark.anyio

KEY_A = "sk-a-0123456789abcdef"
KEY_B = "sk-b-0123456789abcdef"


async def test_tenant_lookup_by_api_key_and_key_stored_hashed(store: Store, raw, prefix):
    tenant = await store.create_tenant("acme", KEY_A)
    assert len(tenant.cache_salt) == 32
    assert tenant.api_key_hash == hashlib.sha256(KEY_A.encode()).hexdigest()

    found = await store.tenant_by_api_key(KEY_A)
    assert found == tenant
    assert await store.tenant_by_api_key(KEY_A + "x") is None
    assert await store.tenant_by_api_key("") is None
    assert await store.get_tenant(tenant.id) == tenant

    # The plain key appears nowhere in Redis.
    async for key in raw.scan_iter(match=f"{prefix}:*"):
        assert KEY_A.encode() not in key
        if await raw.type(key) == b"string":
            assert KEY_A.encode() not in await raw.get(key)


async def test_each_tenant_gets_its_own_salt(store: Store):
    a = await store.create_tenant("a", KEY_A)
    b = await store.create_tenant("b", KEY_B)
    assert a.id != b.id and a.cache_salt != b.cache_salt


async def test_duplicate_or_weak_api_key_is_refused_without_writes(store: Store, raw, prefix):
    await store.create_tenant("a", KEY_A)
    before = sorted([k async for k in raw.scan_iter(match=f"{prefix}:*")])
    with pytest.raises(ValueError, match="already registered"):
        await store.create_tenant("again", KEY_A)
    with pytest.raises(ValueError, match="at least"):
        await store.create_tenant("weak", "short")
    with pytest.raises(ValueError, match="empty"):
        await store.create_tenant("  ", KEY_B)
    assert sorted([k async for k in raw.scan_iter(match=f"{prefix}:*")]) == before
    assert (await store.tenant_by_api_key(KEY_A)).name == "a"


async def test_system_prompts_private_and_shared(store: Store):
    a = await store.create_tenant("a", KEY_A)
    b = await store.create_tenant("b", KEY_B)
    private = await store.create_system_prompt(a.id, "pirate", "Talk like a pirate.", [1, 2], False)
    shared = await store.create_system_prompt(a.id, "helpful", "Be helpful.", [3, 4, 5], True)
    own_b = await store.create_system_prompt(b.id, "terse", "Be terse.", [6], False)

    assert await store.get_system_prompt(a.id, private.id) == private
    assert await store.get_system_prompt(b.id, private.id) is None
    assert await store.get_system_prompt(b.id, shared.id) == shared
    assert await store.get_system_prompt(a.id, own_b.id) is None

    assert [p.id for p in await store.list_system_prompts(a.id)] == [private.id, shared.id]
    assert [p.id for p in await store.list_system_prompts(b.id)] == [shared.id, own_b.id]


async def test_system_prompt_input_is_checked(store: Store):
    a = await store.create_tenant("a", KEY_A)
    with pytest.raises(ValueError, match="non-negative"):
        await store.create_system_prompt(a.id, "x", "text", [1, -2], False)
    with pytest.raises(TypeError, match="shared"):
        await store.create_system_prompt(a.id, "x", "text", [1], "yes")
    with pytest.raises(NotFoundError):
        await store.create_system_prompt("0" * 32, "x", "text", [1], False)
    with pytest.raises(ValueError, match="malformed"):
        await store.get_system_prompt(a.id, "../etc")
    assert await store.list_system_prompts(a.id) == []
