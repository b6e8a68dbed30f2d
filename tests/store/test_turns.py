from __future__ import annotations

import asyncio

import msgspec
import pytest
import redis

from chatsvc.store import SessionBusyError, Store
from chatsvc.store.records import MessageRecord, SessionSummary, decode, encode
from chatsvc.store.tree_read import Tree
from tests.store.helpers import append, new_tenant, turn

pytestmark = pytest.mark.anyio


async def test_a_turn_after_the_active_branch_keeps_text_tokens_usage_and_history(store: Store):
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, "sys", [7, 8], {})
    for n in range(3):
        updated = await append(store, tenant.id, session.id, *turn(n))
    assert updated.num_messages == 7
    assert updated.updated_at >= session.updated_at

    stored = await store.sessions.get(tenant.id, session.id)
    assert stored == updated
    expected_tokens = [7, 8]
    for n in range(3):
        user, assistant = turn(n)
        expected_tokens += user.token_ids + assistant.token_ids
    assert stored.token_ids == expected_tokens

    messages = await store.tree.messages(tenant.id, session.id)
    assert [m.role for m in messages] == ["system"] + ["user", "assistant"] * 3
    assert messages[-1].text == "answer 2" and messages[-1].usage.cached_tokens == 2
    assert messages[-2].usage is None


async def test_a_turn_whose_prompt_was_rendered_again_starts_the_history_over(store: Store):
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, "sys", [7, 8], {})
    # A template that re-renders history hands over the whole new prompt.
    user, assistant = turn(0)
    updated = await append(store, tenant.id, session.id, user, assistant, prompt_token_ids=[9, 9])
    assert updated.token_ids == [9, 9, *assistant.token_ids]
    stored = await store.sessions.get(tenant.id, session.id)
    assert stored.token_ids == [9, 9, *assistant.token_ids]
    asked = (await store.tree.messages(tenant.id, session.id))[1]
    assert asked.from_start and asked.token_ids == [9, 9]


async def test_a_turn_with_bad_messages_is_refused_without_writing(store: Store):
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, "sys", [1], {})
    user, assistant = turn(0)
    with pytest.raises(ValueError, match="assistant"):
        await append(store, tenant.id, session.id, assistant, user)
    with pytest.raises(ValueError, match="role"):
        await append(store, tenant.id, session.id, user, user)
    bad = MessageRecord(role="assistant", text="x", token_ids=[1, "2"])
    with pytest.raises(ValueError, match="token_ids"):
        await append(store, tenant.id, session.id, user, bad)
    with pytest.raises(TypeError):
        await append(store, tenant.id, session.id, user, {"role": "assistant"})
    assert (await store.sessions.get(tenant.id, session.id)) == session
    assert len(await store.tree.messages(tenant.id, session.id)) == 1


async def test_turn_lock_admits_one_holder(store: Store):
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, None, None, {})
    entered = asyncio.Event()
    leave = asyncio.Event()

    async def first():
        async with store.sessions.turn_lock(tenant.id, session.id):
            entered.set()
            await leave.wait()

    holder = asyncio.create_task(first())
    await entered.wait()
    with pytest.raises(SessionBusyError):
        async with store.sessions.turn_lock(tenant.id, session.id):
            pytest.fail("a second holder got in")
    leave.set()
    await holder
    async with store.sessions.turn_lock(tenant.id, session.id):
        pass  # free again once the first holder left


async def test_turn_lock_released_on_exception(store: Store, raw, prefix):
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, None, None, {})
    with pytest.raises(RuntimeError, match="engine died"):
        async with store.sessions.turn_lock(tenant.id, session.id):
            raise RuntimeError("engine died")
    assert await raw.exists(f"{prefix}:session:{{{session.id}}}:lock") == 0
    async with store.sessions.turn_lock(tenant.id, session.id):
        pass


async def test_turn_lock_of_a_dead_holder_expires_and_is_extended_while_held(redis_server, prefix):
    store = await Store.connect(redis_server.url, prefix=prefix, lock_ttl_s=0.3)
    other = await Store.connect(redis_server.url, prefix=prefix, lock_ttl_s=0.3)
    try:
        tenant = await new_tenant(store)
        session = await store.sessions.create(tenant.id, None, None, None, {})
        async with store.sessions.turn_lock(tenant.id, session.id):
            # Held for three TTLs: the keep-alive must keep the lock ours.
            await asyncio.sleep(0.9)
            with pytest.raises(SessionBusyError):
                async with other.sessions.turn_lock(tenant.id, session.id):
                    pass
        # A holder that vanished without releasing (process killed): the
        # lock key is left behind and must free itself after its TTL.
        await store.redis.set(f"{prefix}:session:{{{session.id}}}:lock", "dead", px=300)
        with pytest.raises(SessionBusyError):
            async with other.sessions.turn_lock(tenant.id, session.id):
                pass
        await asyncio.sleep(0.6)
        async with other.sessions.turn_lock(tenant.id, session.id):
            pass
    finally:
        await store.close()
        await other.close()


def _interfere_before_commit(monkeypatch, action, times: int) -> list[int]:
    """Run ``action`` (blocking) inside a turn's write, after its read and before its write."""
    original = Tree.read_branch
    calls = []

    async def read_branch(self, *args, **kwargs):
        branch = await original(self, *args, **kwargs)
        calls.append(1)
        if len(calls) <= times:
            action()
        return branch

    monkeypatch.setattr(Tree, "read_branch", read_branch)
    return calls


async def test_rival_write_between_read_and_commit_is_redone_from_a_fresh_read(
    store: Store, redis_server, prefix, monkeypatch
):
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, "sys", [1], {})
    key = f"{prefix}:session:{{{session.id}}}"
    rival = redis.Redis.from_url(redis_server.url)

    def rewrite() -> None:
        # Another writer changes the summary (here: its metadata) under our feet.
        changed = msgspec.structs.replace(
            decode(SessionSummary, rival.get(key)), metadata={"rival": "1"}
        )
        rival.set(key, encode(changed))

    calls = _interfere_before_commit(monkeypatch, rewrite, times=1)
    try:
        updated = await append(store, tenant.id, session.id, *turn(1))
    finally:
        rival.close()
    assert len(calls) == 2  # the first commit saw a changed summary and wrote nothing
    messages = await store.tree.messages(tenant.id, session.id)
    assert [m.text for m in messages] == ["sys", "question 1", "answer 1"]
    stored = await store.sessions.get(tenant.id, session.id)
    assert updated == stored and stored.num_messages == 3 and stored.metadata == {"rival": "1"}


def _kill_clients_named(url: str, name: str):
    def kill() -> None:
        admin = redis.Redis.from_url(url)
        try:
            for client in admin.client_list():
                if client.get("name") == name:
                    admin.client_kill_filter(_id=client["id"])
        finally:
            admin.close()

    return kill


async def test_connection_killed_before_the_commit_commits_once(redis_server, prefix, monkeypatch):
    # The commit carries its own checks, so a connection lost before it is sent
    # just reconnects (a WATCH would have died with the connection).
    store = await Store.connect(redis_server.url, prefix=prefix, client_name=f"victim-{prefix}")
    try:
        tenant = await new_tenant(store)
        session = await store.sessions.create(tenant.id, None, "sys", [1], {})
        kill = _kill_clients_named(redis_server.url, f"victim-{prefix}")
        calls = _interfere_before_commit(monkeypatch, kill, times=1)
        await append(store, tenant.id, session.id, *turn(2))
        assert len(calls) == 1
        texts = [m.text for m in await store.tree.messages(tenant.id, session.id)]
        assert texts == ["sys", "question 2", "answer 2"]
        assert (await store.sessions.get(tenant.id, session.id)).num_messages == 3
    finally:
        await store.close()
