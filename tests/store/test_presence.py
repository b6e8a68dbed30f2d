"""Presence (chatsvc/store/presence.py): a turn lock whose holder's instance is gone is
taken over once that instance's key lapses, well before the lock's own TTL; a live
holder's lock never is, however long its turn; a taken-over holder cannot commit."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from chatsvc.store import SessionBusyError, Store, TurnLockLostError
from chatsvc.store import context as store_context
from chatsvc.store.lock import RedisLock
from tests.store.helpers import commit_after, new_tenant, turn

pytestmark = pytest.mark.anyio

ALIVE_S = 0.4  # the presence TTL these tests run with; the locks' TTL stays 30 s


@pytest.fixture
def short_presence(monkeypatch):
    monkeypatch.setattr(store_context, "ALIVE_TTL_S", ALIVE_S)


@pytest.fixture
async def stores(redis_server, prefix):
    """Two instances on one Redis, as two replicas, with turn locks of 30 s."""
    pair = [await Store.connect(redis_server.url, prefix=prefix, lock_ttl_s=30) for _ in "ab"]
    yield pair
    for store in pair:
        await store.close()


async def takes_turn(store: Store, tenant_id: str, session_id: str) -> bool:
    """Whether a turn of ``store`` gets the session's lock now (released again at once);
    a lock it gets names its instance."""
    try:
        async with store.sessions.turn_lock(tenant_id, session_id) as lock:
            assert lock.token.startswith(store.context.presence.instance_id + ":")
    except SessionBusyError:
        return False
    return True


async def _texts(store: Store, tenant_id: str, session_id: str) -> list[str]:
    return [m.text for m in await store.tree.messages(tenant_id, session_id)]


async def test_a_gone_instances_lock_is_taken_over_and_its_commit_refused(
    short_presence, stores, raw
):
    gone, other = stores
    tenant = await new_tenant(gone)
    session = await gone.sessions.create(tenant.id, None, "sys", [1], {})
    lock_key = gone.keys.session_lock(session.id)
    # A turn held by `gone`, whose process then stops (no release, no refresh).
    stale = RedisLock(gone.redis, lock_key, 30, gone.context.presence)
    assert await stale.acquire()
    assert stale.token.startswith(gone.context.presence.instance_id + ":")
    gone.context.presence._task.cancel()
    # Its presence key has not lapsed yet.
    assert not await takes_turn(other, tenant.id, session.id)
    await asyncio.sleep(ALIVE_S * 1.5)
    assert await raw.exists(gone.context.presence.key) == 0
    assert await raw.pttl(lock_key) > 20_000  # the lock itself is far from expiring
    async with other.sessions.turn_lock(tenant.id, session.id) as fresh:
        assert await raw.get(lock_key) == fresh.token.encode()
        with pytest.raises(TurnLockLostError):
            await commit_after(gone, tenant.id, session.id, *turn(1), lock=stale)
        await commit_after(other, tenant.id, session.id, *turn(2), lock=fresh)
    assert await _texts(other, tenant.id, session.id) == ["sys", "question 2", "answer 2"]


async def test_a_live_holders_lock_is_never_taken_over(short_presence, stores):
    holder, other = stores
    tenant = await new_tenant(holder)
    session = await holder.sessions.create(tenant.id, None, None, None, {})
    async with holder.sessions.turn_lock(tenant.id, session.id):
        for _ in range(4):  # 2.5 presence TTLs: refreshed all along
            await asyncio.sleep(ALIVE_S * 0.6)
            assert not await takes_turn(other, tenant.id, session.id)
    # A lock without an instance (as written before presence) waits for its TTL.
    await holder.redis.set(holder.keys.session_lock(session.id), "0123abcd", px=30_000)
    await asyncio.sleep(ALIVE_S * 1.5)
    assert not await takes_turn(other, tenant.id, session.id)


async def test_a_closed_store_leaves_no_presence(stores, raw):
    store, other = stores
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, None, None, {})
    lock_key = store.keys.session_lock(session.id)
    assert await raw.exists(store.context.presence.key) == 1
    left = RedisLock(store.redis, lock_key, 30, store.context.presence)
    assert await left.acquire()
    await store.close()  # a shutdown: its key goes with it, its locks are free at once
    assert await raw.exists(store.context.presence.key) == 0
    assert await takes_turn(other, tenant.id, session.id)


HOLDER = """
import asyncio, sys
from chatsvc.store import Store

async def main(url, prefix, tenant_id, session_id):
    store = await Store.connect(url, prefix=prefix, lock_ttl_s=30)
    async with store.sessions.turn_lock(tenant_id, session_id):
        print("held", flush=True)
        await asyncio.sleep(600)

asyncio.run(main(*sys.argv[1:]))
"""


async def test_a_killed_process_blocks_its_session_for_the_presence_ttl_not_the_locks(
    redis_server, prefix
):
    """A real process holds a turn and is killed (SIGKILL): with the default presence TTL
    (5 s), its session is free again well before the lock's 30 s."""
    store = await Store.connect(redis_server.url, prefix=prefix, lock_ttl_s=30)
    try:
        tenant = await new_tenant(store)
        session = await store.sessions.create(tenant.id, None, None, None, {})
        args = [redis_server.url, prefix, tenant.id, session.id]
        child = subprocess.Popen(
            [sys.executable, "-c", HOLDER, *args], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout.readline().strip() == "held"
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.wait(timeout=30)
        killed = time.monotonic()
        assert not await takes_turn(store, tenant.id, session.id)
        while not await takes_turn(store, tenant.id, session.id):
            assert time.monotonic() - killed < 15, "still busy long after the kill"
            await asyncio.sleep(0.1)
        assert time.monotonic() - killed <= store_context.ALIVE_TTL_S + 1
    finally:
        await store.close()
