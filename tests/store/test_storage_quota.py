"""Byte quotas: every write counts what it stores, in the script that writes it.

The counters are checked against Redis itself: a session's bytes are the length
of its token history plus every value of its ``nodes`` and ``responses`` hashes.
"""

from __future__ import annotations

import asyncio

import pytest

from chatsvc.store import StorageQuotaError, Store
from chatsvc.store.commit import TOTAL
from chatsvc.store.records import MessageRecord, ResponseRecord
from chatsvc.store.responses import new_response_id
from tests.store.helpers import new_tenant, turn

pytestmark = pytest.mark.anyio


async def _measured(raw, keys, session_id: str) -> int:
    """The bytes the session's records take, measured in Redis."""
    size = await raw.strlen(keys.session_tokens(session_id))
    for key in (keys.session_nodes(session_id), keys.session_responses(session_id)):
        for field in await raw.hkeys(key):
            size += await raw.hstrlen(key, field)
    return size


async def _counters(raw, keys, tenant_id: str) -> dict[str, int]:
    return {
        k.decode(): int(v) for k, v in (await raw.hgetall(keys.tenant_bytes(tenant_id))).items()
    }


async def _snapshot(raw, prefix: str) -> dict[bytes, bytes]:
    """Every key under ``prefix`` with its serialized value, the turn lock aside (its
    holder changes): what a refused write must keep."""
    return {
        key: await raw.dump(key)
        async for key in raw.scan_iter(match=f"{prefix}:*")
        if not key.endswith(b":lock")
    }


def _items(n: int, chars: int = 50) -> list[MessageRecord]:
    return [MessageRecord(role="user", text="x" * chars, token_ids=[]) for _ in range(n)]


async def test_counters_follow_every_write_and_delete_exactly(store: Store, raw):
    keys = store.keys
    tenant = await new_tenant(store)
    a = await store.sessions.create(tenant.id, None, "sys", [1, 2], {})
    b = await store.sessions.create(tenant.id, None, None, None, {}, messages=_items(3))

    async def check() -> None:
        counters = await _counters(raw, keys, tenant.id)
        sessions = [sid for sid in counters if sid != TOTAL]
        for sid in sessions:
            assert counters[sid] == await _measured(raw, keys, sid)
        assert counters[TOTAL] == sum(counters[sid] for sid in sessions)
        assert await store.sessions.bytes_used(tenant.id) == counters[TOTAL]
        assert await store.sessions.storage(tenant.id, a.id) == (counters[a.id], counters[TOTAL])

    await check()
    async with store.sessions.turn_lock(tenant.id, a.id) as lock:
        user, answer = turn(1)
        response = ResponseRecord(
            id=new_response_id(a.id),
            session_id=a.id,
            created_at=0.0,
            completed_at=0.0,
            model="m",
            status="completed",
            input_ids=[],
            output_id="",
        )
        first = await store.branches.commit_turn(
            tenant.id,
            a.id,
            parent_id=a.active_leaf,
            inputs=[user],
            output=answer,
            prompt_token_ids=[1, 2, 1001, 1],
            lock=lock,
            response=response,
        )
        await check()
        # An edit: a second branch below the system message, with the whole prompt.
        user2, answer2 = turn(2)
        await store.branches.commit_turn(
            tenant.id,
            a.id,
            parent_id=a.active_leaf,
            inputs=[user2],
            output=answer2,
            prompt_token_ids=[9, 9, 9],
            lock=lock,
        )
        await check()
        await store.branches.delete(tenant.id, a.id, first.messages[0].id, lock=lock)
        await check()
    async with store.sessions.turn_lock(tenant.id, b.id) as lock:
        written = await store.branches.add_messages(tenant.id, b.id, _items(4, 500), lock=lock)
        await check()
        await store.branches.delete_message(tenant.id, b.id, written.messages[1].id, lock=lock)
        await check()
        # The last message: nothing below it moves up.
        await store.branches.delete_message(tenant.id, b.id, written.messages[-1].id, lock=lock)
        await check()
    assert await store.sessions.delete(tenant.id, b.id)
    await check()
    assert b.id not in await _counters(raw, keys, tenant.id)


async def test_an_expired_session_leaves_the_total_when_a_listing_prunes_it(
    redis_server, prefix, raw
):
    store = await Store.connect(redis_server.url, prefix=prefix, session_ttl_s=0.2)
    try:
        tenant = await new_tenant(store)
        await store.sessions.create(tenant.id, None, None, None, {}, messages=_items(2))
        assert await store.sessions.bytes_used(tenant.id) > 0
        await asyncio.sleep(0.4)
        assert await store.sessions.list_page(tenant.id) == ([], None)
        assert await _counters(raw, store.keys, tenant.id) == {TOTAL: 0}
    finally:
        await store.close()


async def test_a_write_past_the_session_quota_is_refused_and_writes_nothing(
    redis_server, prefix, raw
):
    store = await Store.connect(redis_server.url, prefix=prefix, max_session_bytes=2_000)
    try:
        tenant = await new_tenant(store)
        session = await store.sessions.create(tenant.id, None, None, None, {}, messages=_items(2))
        before = await _snapshot(raw, prefix)
        async with store.sessions.turn_lock(tenant.id, session.id) as lock:
            with pytest.raises(StorageQuotaError, match=r"max_session_bytes=2000"):
                await store.branches.add_messages(
                    tenant.id, session.id, _items(3, 1_000), lock=lock
                )
            after = await _snapshot(raw, prefix)
        assert after == before
        with pytest.raises(StorageQuotaError, match=r"max_session_bytes=2000"):
            await store.sessions.create(tenant.id, None, None, None, {}, messages=_items(3, 1_000))
        # A write that frees bytes passes, and so does one that fits.
        async with store.sessions.turn_lock(tenant.id, session.id) as lock:
            await store.branches.add_messages(tenant.id, session.id, _items(1), lock=lock)
    finally:
        await store.close()


async def test_a_tenant_at_its_quota_does_not_stop_another_tenant(redis_server, prefix, raw):
    store = await Store.connect(redis_server.url, prefix=prefix, max_tenant_bytes=3_000)
    try:
        full, other = await new_tenant(store), await new_tenant(store)
        await store.sessions.create(full.id, None, None, None, {}, messages=_items(2, 1_000))
        before = await _snapshot(raw, prefix)
        with pytest.raises(StorageQuotaError, match=r"max_tenant_bytes=3000"):
            await store.sessions.create(full.id, None, None, None, {}, messages=_items(2, 1_000))
        assert await _snapshot(raw, prefix) == before
        await store.sessions.create(other.id, None, None, None, {}, messages=_items(2, 1_000))
        assert await store.sessions.bytes_used(other.id) > 2_000
    finally:
        await store.close()


async def test_expired_sessions_do_not_hold_a_tenant_at_its_quota(redis_server, prefix, raw):
    store = await Store.connect(
        redis_server.url, prefix=prefix, session_ttl_s=0.8, max_tenant_bytes=3_000
    )
    try:
        tenant = await new_tenant(store)
        index = store.keys.tenant_sessions(tenant.id)

        async def create(*chars: int):
            messages = [MessageRecord(role="user", text="x" * n, token_ids=[]) for n in chars]
            return await store.sessions.create(tenant.id, None, None, None, {}, messages=messages)

        # No listing prunes them here: a refused write forgets the expired sessions itself.
        gone = await create(1_300, 1_300)
        await asyncio.sleep(1.0)
        await create(400)  # past the quota while the expired bytes count: a create
        assert await raw.zscore(index, gone.id) is None
        gone = await create(1_200)
        await asyncio.sleep(1.0)
        last = await create(10)
        async with store.sessions.turn_lock(tenant.id, last.id) as lock:
            await store.branches.add_messages(tenant.id, last.id, _items(2, 1_000), lock=lock)
        assert await raw.zscore(index, gone.id) is None
        assert await store.sessions.bytes_used(tenant.id) < 3_000
    finally:
        await store.close()
