"""Tenants by name, private system prompts, shared ones the operator publishes, caps, delete."""

from __future__ import annotations

import asyncio

import pytest

from chatsvc.store import NotFoundError, Store
from chatsvc.store.errors import LimitExceededError
from tests.store.helpers import append, new_tenant, turn

pytestmark = pytest.mark.anyio


async def _keyspace(raw, prefix: str) -> list[bytes]:
    return sorted([k async for k in raw.scan_iter(match=f"{prefix}:*")])


async def test_a_name_is_one_tenant_for_good(store: Store):
    acme = await store.tenants.ensure("acme")
    assert len(acme.cache_salt) == 32 and acme.name == "acme"
    assert await store.tenants.ensure("acme") == acme
    assert await store.tenants.by_name("acme") == acme
    assert await store.tenants.by_name(acme.name) == acme
    assert await store.tenants.by_name("nobody") is None
    other = await store.tenants.ensure("globex")
    assert other.id != acme.id and other.cache_salt != acme.cache_salt


async def test_replicas_ensuring_one_name_together_agree_on_one_tenant(redis_server, prefix, raw):
    # Separate connections, as separate replicas starting at once would have.
    stores = [await Store.connect(redis_server.url, prefix=prefix) for _ in range(8)]
    try:
        tenants = await asyncio.gather(*(s.tenants.ensure("acme") for s in stores))
    finally:
        for s in stores:
            await s.close()
    assert len({t.id for t in tenants}) == 1 and len({t.cache_salt for t in tenants}) == 1
    records = [k async for k in raw.scan_iter(match=f"{prefix}:tenant:*", _type="string")]
    assert records == [f"{prefix}:tenant:{tenants[0].id}".encode()]


async def test_bad_tenant_names_are_refused_without_writes(store: Store, raw, prefix):
    before = await _keyspace(raw, prefix)
    for name in ("", "   ", "x" * 201):
        with pytest.raises(ValueError):
            await store.tenants.ensure(name)
    assert await _keyspace(raw, prefix) == before


async def test_private_prompts_are_the_owners_and_shared_ones_everyones(store: Store):
    a = await new_tenant(store, "a")
    b = await new_tenant(store, "b")
    private = await store.prompts.create(a.id, "pirate", "Talk like a pirate.", [1, 2])
    shared = await store.prompts.create_shared("helpful", "Be helpful.", [3, 4, 5])
    own_b = await store.prompts.create(b.id, "terse", "Be terse.", [6], False)
    assert (private.tenant_id, private.shared) == (a.id, False)
    assert (shared.tenant_id, shared.shared) == (None, True)

    assert await store.prompts.get(a.id, private.id) == private
    assert await store.prompts.get(b.id, private.id) is None
    assert await store.prompts.get(b.id, shared.id) == shared
    assert await store.prompts.get(a.id, own_b.id) is None

    assert [p.id for p in await store.prompts.visible(a.id)] == [private.id, shared.id]
    assert [p.id for p in await store.prompts.visible(b.id)] == [shared.id, own_b.id]
    assert [p.id for p in await store.prompts.all_shared()] == [shared.id]


async def test_a_tenant_cannot_create_a_shared_prompt(store: Store, raw, prefix):
    a = await new_tenant(store)
    before = await _keyspace(raw, prefix)
    with pytest.raises(ValueError, match="cannot be shared"):
        await store.prompts.create(a.id, "mine", "Be kind.", [1], True)
    assert await _keyspace(raw, prefix) == before
    assert await store.prompts.all_shared() == []


async def test_system_prompt_input_is_checked(store: Store, raw, prefix):
    a = await new_tenant(store)
    before = await _keyspace(raw, prefix)
    with pytest.raises(ValueError, match="non-negative"):
        await store.prompts.create(a.id, "x", "text", [1, -2], False)
    with pytest.raises(TypeError, match="shared"):
        await store.prompts.create(a.id, "x", "text", [1], "yes")
    with pytest.raises(NotFoundError):
        await store.prompts.create("0" * 32, "x", "text", [1], False)
    with pytest.raises(ValueError, match="empty"):
        await store.prompts.create_shared("x", " ", [1])
    with pytest.raises(ValueError, match="malformed"):
        await store.prompts.get(a.id, "../etc")
    with pytest.raises(ValueError, match="malformed"):
        await store.prompts.delete(a.id, "../etc")
    assert await store.prompts.visible(a.id) == []
    assert await _keyspace(raw, prefix) == before


async def test_caps_hold_under_racing_creates(store: Store, raw, prefix):
    a = await new_tenant(store)
    creates = (store.prompts.create(a.id, f"p{i}", f"P{i}.", [i], limit=3) for i in range(8))
    results = await asyncio.gather(*creates, return_exceptions=True)
    assert sum(not isinstance(r, BaseException) for r in results) == 3
    assert all(isinstance(r, LimitExceededError) for r in results if isinstance(r, BaseException))
    assert len(await store.prompts.visible(a.id)) == 3
    # Nothing of the refused ones was written.
    assert len([k async for k in raw.scan_iter(match=f"{prefix}:prompt:*")]) == 3

    shared = await asyncio.gather(
        *(store.prompts.create_shared(f"s{i}", f"Shared {i}.", [i], limit=2) for i in range(5)),
        return_exceptions=True,
    )
    assert sum(not isinstance(r, BaseException) for r in shared) == 2
    assert len(await store.prompts.all_shared()) == 2
    # Deleting frees room under the cap again.
    own = await store.prompts.visible(a.id)
    private = [p for p in own if not p.shared]
    assert await store.prompts.delete(a.id, private[0].id)
    await store.prompts.create(a.id, "again", "Again.", [9], limit=3)


async def test_delete_is_the_owners_and_shared_ones_the_operators(store: Store, raw, prefix):
    a = await new_tenant(store, "a")
    b = await new_tenant(store, "b")
    mine = await store.prompts.create(a.id, "mine", "Mine.", [1])
    shared = await store.prompts.create_shared("all", "For all.", [2])

    before = await _keyspace(raw, prefix)
    assert not await store.prompts.delete(b.id, mine.id)  # another tenant's
    assert not await store.prompts.delete(a.id, shared.id)  # a tenant cannot withdraw
    assert not await store.prompts.delete_shared(mine.id)  # not a shared one
    assert not await store.prompts.delete(a.id, "0" * 32)  # unknown
    assert await _keyspace(raw, prefix) == before

    assert await store.prompts.delete(a.id, mine.id)
    assert await store.prompts.get(a.id, mine.id) is None
    assert not await store.prompts.delete(a.id, mine.id)
    assert await store.prompts.delete_shared(shared.id)
    assert await store.prompts.visible(a.id) == []
    assert await store.prompts.all_shared() == []
    assert [k async for k in raw.scan_iter(match=f"{prefix}:prompt:*")] == []


async def test_a_session_outlives_the_prompt_it_started_on(store: Store):
    a = await new_tenant(store)
    prompt = await store.prompts.create(a.id, "p", "Be brief.", [5, 6])
    session = await store.sessions.create(a.id, prompt.id, prompt.text, prompt.token_ids, {})
    assert await store.prompts.delete(a.id, prompt.id)

    user, assistant = turn(1)
    updated = await append(store, a.id, session.id, user, assistant)
    assert updated.token_ids == [5, 6, *user.token_ids, *assistant.token_ids]
    messages = await store.tree.messages(a.id, session.id)
    assert [(m.role, m.text) for m in messages][0] == ("system", "Be brief.")
    assert len(messages) == 3
