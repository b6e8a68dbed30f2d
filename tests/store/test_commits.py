"""Commits are fenced by the turn lock and idempotent: a real Redis, real stalls, lost replies.

The lost replies come from ``ReplyDroppingProxy``: the write reaches Redis and
is applied, the reply never reaches the client, and redis-py sends it again.
"""

from __future__ import annotations

import time

import pytest

from chatsvc.store import Store, TurnLockLostError
from chatsvc.store.commit import REMEMBERED_COMMITS
from tests.store.helpers import append, commit_after, new_tenant, turn
from tests.store.reply_proxy import ReplyDroppingProxy

pytestmark = pytest.mark.anyio


async def _texts(store: Store, tenant_id: str, session_id: str) -> list[str]:
    return [m.text for m in await store.tree.messages(tenant_id, session_id)]


async def test_a_turn_whose_lock_expired_and_was_taken_cannot_commit(redis_server, prefix, raw):
    store = await Store.connect(redis_server.url, prefix=prefix, lock_ttl_s=0.2)
    other = await Store.connect(redis_server.url, prefix=prefix, lock_ttl_s=30)
    try:
        tenant = await new_tenant(store)
        session = await store.sessions.create(tenant.id, None, "sys", [1], {})
        lock_key = store.keys.session_lock(session.id)
        async with store.sessions.turn_lock(tenant.id, session.id) as stale:
            # The event loop stalls (blocking work) for longer than the lock's TTL:
            # its keep-alive cannot run, so the lock expires in Redis...
            time.sleep(0.6)
            # ...and another turn (another replica) takes the session.
            async with other.sessions.turn_lock(tenant.id, session.id) as fresh:
                assert await raw.get(lock_key) == fresh.token.encode()
                with pytest.raises(TurnLockLostError, match="not stored"):
                    await commit_after(store, tenant.id, session.id, *turn(1), lock=stale)
                assert await _texts(store, tenant.id, session.id) == ["sys"]
                await commit_after(other, tenant.id, session.id, *turn(2), lock=fresh)
        assert await _texts(store, tenant.id, session.id) == ["sys", "question 2", "answer 2"]
        stored = await store.sessions.get(tenant.id, session.id)
        assert stored.num_messages == 3 and stored.token_ids == [1, 1002, 1, 2002, 2, 3]
    finally:
        await store.close()
        await other.close()


async def test_an_expired_lock_nobody_took_is_still_refused(store: Store, raw):
    # Nobody holds the key now, but somebody may have held, committed and released
    # it in between: only the holder's own token lets a turn commit.
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, "sys", [1], {})
    async with store.sessions.turn_lock(tenant.id, session.id) as lock:
        await raw.delete(store.keys.session_lock(session.id))
        with pytest.raises(TurnLockLostError):
            await commit_after(store, tenant.id, session.id, *turn(1), lock=lock)
    assert await _texts(store, tenant.id, session.id) == ["sys"]


async def test_a_turn_refuses_a_lock_of_another_session(store: Store):
    tenant = await new_tenant(store)
    first = await store.sessions.create(tenant.id, None, "sys", [1], {})
    second = await store.sessions.create(tenant.id, None, "sys", [1], {})
    async with store.sessions.turn_lock(tenant.id, first.id) as lock:
        with pytest.raises(ValueError, match="turn lock"):
            await commit_after(store, tenant.id, second.id, *turn(1), lock=lock)
    assert await _texts(store, tenant.id, second.id) == ["sys"]


async def test_the_same_turn_id_is_applied_once(store: Store, raw):
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, "sys", [1], {})
    async with store.sessions.turn_lock(tenant.id, session.id) as lock:
        first = await commit_after(store, tenant.id, session.id, *turn(1), lock=lock, turn_id="t-1")
        again = await commit_after(store, tenant.id, session.id, *turn(1), lock=lock, turn_id="t-1")
        assert again == first  # the resend reports what the first send stored
        await commit_after(store, tenant.id, session.id, *turn(2), lock=lock, turn_id="t-2")
    assert await _texts(store, tenant.id, session.id) == [
        "sys",
        "question 1",
        "answer 1",
        "question 2",
        "answer 2",
    ]
    assert (await store.sessions.get(tenant.id, session.id)).num_messages == 5
    assert await raw.lrange(store.keys.session_commits(session.id), 0, -1) == [b"t-2", b"t-1"]


async def test_only_the_newest_turn_ids_are_remembered(store: Store, raw):
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, None, None, {})
    async with store.sessions.turn_lock(tenant.id, session.id) as lock:
        for n in range(REMEMBERED_COMMITS + 4):
            await commit_after(store, tenant.id, session.id, *turn(n), lock=lock, turn_id=f"t{n}")
    remembered = await raw.lrange(store.keys.session_commits(session.id), 0, -1)
    assert len(remembered) == REMEMBERED_COMMITS and remembered[0] == f"t{n}".encode()


@pytest.mark.parametrize("bad", ["", "x" * 129, 7])
async def test_a_malformed_turn_id_is_refused_before_anything_is_written(store: Store, bad):
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, "sys", [1], {})
    with pytest.raises(ValueError, match="turn_id"):
        await append(store, tenant.id, session.id, *turn(1), turn_id=bad)
    assert await _texts(store, tenant.id, session.id) == ["sys"]


@pytest.fixture
async def proxy(redis_server):
    proxy = await ReplyDroppingProxy(redis_server.url).start()
    yield proxy
    await proxy.stop()


@pytest.fixture
async def proxied(proxy, prefix):
    store = await Store.connect(proxy.url, prefix=prefix)
    yield store
    await store.close()


async def test_a_commit_whose_reply_was_lost_is_stored_once(proxied: Store, proxy):
    store = proxied
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, "sys", [1], {})
    await append(store, tenant.id, session.id, *turn(1))  # the script is loaded by now
    proxy.arm(b"turn-lost-reply", commands=(b"EVALSHA",))
    updated = await append(store, tenant.id, session.id, *turn(2), turn_id="turn-lost-reply")
    assert proxy.dropped == 1  # Redis applied it, the client never heard, redis-py resent it
    texts = await _texts(store, tenant.id, session.id)
    assert texts == ["sys", "question 1", "answer 1", "question 2", "answer 2"]
    stored = await store.sessions.get(tenant.id, session.id)
    assert updated == stored and stored.num_messages == 5
    assert stored.token_ids == [1, 1001, 1, 2001, 2, 3, 1002, 1, 2002, 2, 3]


async def test_a_create_whose_reply_was_lost_creates_one_session(proxied: Store, proxy, raw):
    store = proxied
    tenant = await new_tenant(store)
    # The tenant id names the index key the create writes; reads never carry EXEC/EVALSHA.
    proxy.arm(tenant.id.encode())
    session = await store.sessions.create(tenant.id, None, "sys", [1], {"k": "v"})
    assert proxy.dropped == 1
    listed, _ = await store.sessions.list_page(tenant.id)
    assert [s.id for s in listed] == [session.id]
    assert await raw.zcard(store.keys.tenant_sessions(tenant.id)) == 1
    assert await _texts(store, tenant.id, session.id) == ["sys"]
    assert await store.sessions.get(tenant.id, session.id) == session


async def test_a_lock_whose_reply_was_lost_is_still_taken(proxied: Store, proxy, raw):
    store = proxied
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, "sys", [1], {})
    lock_key = store.keys.session_lock(session.id)
    proxy.arm(lock_key.encode(), commands=(b"SET",))
    async with store.sessions.turn_lock(tenant.id, session.id) as lock:
        assert proxy.dropped == 1
        assert await raw.get(lock_key) == lock.token.encode()
        await commit_after(store, tenant.id, session.id, *turn(1), lock=lock)
    assert await raw.exists(lock_key) == 0  # released, not left to its TTL
    assert await _texts(store, tenant.id, session.id) == ["sys", "question 1", "answer 1"]
