from __future__ import annotations

import asyncio

import msgspec
import pytest

import chatsvc.store.schema as runner
from chatsvc.store import SchemaVersionError, Store
from chatsvc.store.keys import Keys
from chatsvc.store.records import (
    SCHEMA_VERSION,
    MessageRecord,
    SessionRecord,
    SessionSummary,
    TenantRecord,
    decode,
    decode_tokens,
    encode,
    encode_tokens,
)
from chatsvc.store.schema import Migration, migrate
from migrations import (
    m0002_session_index_zset,
    m0004_session_tokens_key,
    m0005_message_tree,
    m0006_storage_bytes,
)
from tests.store.helpers import commit_after

pytestmark = pytest.mark.anyio


def _before_layout_5(record):
    """``record`` without what migration 0005 adds (its active message, its tree size)."""
    return msgspec.structs.replace(record, active_leaf=None, num_nodes=0)


def test_schema_version_names_the_newest_migration():
    versions = [m.version for m in runner.all_migrations()]
    assert versions == list(range(1, len(versions) + 1))
    assert SCHEMA_VERSION == versions[-1]


async def test_fresh_keyspace_gets_every_migration_once(redis_server, prefix, raw):
    labels = [m.label for m in runner.all_migrations()]
    assert labels == [
        "0001_initial",
        "0002_session_index_zset",
        "0003_tenant_names_and_operator_prompts",
        "0004_session_tokens_key",
        "0005_message_tree",
        "0006_storage_bytes",
    ]
    assert await migrate(redis_server.url, prefix) == labels
    assert await migrate(redis_server.url, prefix) == []
    assert await raw.get(f"{prefix}:schema_version") == str(SCHEMA_VERSION).encode()
    assert await raw.hget(f"{prefix}:meta", "layout") == str(SCHEMA_VERSION).encode()


async def _write_layout_1(raw, keys: Keys) -> tuple[TenantRecord, list[SessionRecord]]:
    """Data as chatsvc wrote it at schema version 1: session index as a plain SET."""
    tenant = TenantRecord(
        id="t1", name="old", api_key_hash="0" * 64, cache_salt=b"s" * 32, created_at=1.0
    )
    await raw.set(keys.tenant(tenant.id), encode(tenant))
    sessions = []
    for n, updated_at in enumerate([30.0, 10.0, 20.0]):
        session = SessionRecord(
            id=f"s{n}",
            tenant_id=tenant.id,
            system_prompt_id=None,
            metadata={"n": str(n)},
            created_at=1.0,
            updated_at=updated_at,
            num_messages=1,
            token_ids=[n],
        )
        message = MessageRecord(role="system", text=f"sys {n}", token_ids=[n], created_at=1.0)
        await raw.set(keys.session(session.id), encode(session))
        await raw.rpush(keys.session_messages(session.id), encode(message))
        sessions.append(session)
    # "gone" is in the index but its record expired long ago.
    await raw.sadd(keys.tenant_sessions(tenant.id), "s0", "s1", "s2", "gone")
    await raw.set(keys.schema_version(), 1)
    return tenant, sessions


async def test_layout_1_data_is_upgraded_and_readable_through_the_store(redis_server, prefix, raw):
    keys = Keys(prefix)
    tenant, sessions = await _write_layout_1(raw, keys)

    store = await Store.connect(redis_server.url, prefix=prefix)
    try:
        assert await raw.type(keys.tenant_sessions(tenant.id)) == b"zset"
        assert await raw.get(keys.schema_version()) == str(SCHEMA_VERSION).encode()
        listed, cursor = await store.sessions.list_page(tenant.id)
        assert [s.id for s in listed] == ["s0", "s2", "s1"] and cursor is None
        assert await raw.zscore(keys.tenant_sessions(tenant.id), "gone") is None
        stored = await store.sessions.get(tenant.id, "s1")
        assert _before_layout_5(stored) == sessions[1]
        assert stored.num_nodes == 1 and stored.active_leaf.startswith("msg_")
        messages = await store.tree.messages(tenant.id, "s2")
        assert [m.text for m in messages] == ["sys 2"]
    finally:
        await store.close()


async def test_session_index_migration_is_idempotent(redis_server, prefix, raw):
    keys = Keys(prefix)
    tenant, _ = await _write_layout_1(raw, keys)
    await m0002_session_index_zset.up(raw, keys)
    once = await raw.zrange(keys.tenant_sessions(tenant.id), 0, -1, withscores=True)
    await m0002_session_index_zset.up(raw, keys)
    assert await raw.zrange(keys.tenant_sessions(tenant.id), 0, -1, withscores=True) == once
    assert once == [(b"s1", 10.0), (b"s2", 20.0), (b"s0", 30.0)]
    assert [k async for k in raw.scan_iter(match=f"{prefix}:*m0002*")] == []


async def test_concurrent_runners_apply_each_migration_once(redis_server, prefix, monkeypatch):
    runs: dict[int, int] = {}
    real = runner.all_migrations()

    def counted(migration: Migration) -> Migration:
        async def up(client, keys):
            runs[migration.version] = runs.get(migration.version, 0) + 1
            # Slow enough that the other runner certainly arrives while we hold the lock.
            await asyncio.sleep(0.2)
            await migration.up(client, keys)

        return Migration(migration.version, migration.name, up)

    monkeypatch.setattr(runner, "all_migrations", lambda: tuple(counted(m) for m in real))
    results = await asyncio.gather(*(migrate(redis_server.url, prefix) for _ in range(3)))
    assert runs == {m.version: 1 for m in real}
    assert sorted(len(r) for r in results) == [0, 0, len(real)]


async def test_keyspace_newer_than_code_is_refused(redis_server, prefix, raw):
    await raw.set(f"{prefix}:schema_version", SCHEMA_VERSION + 1)
    with pytest.raises(SchemaVersionError, match="upgrade chatsvc"):
        await Store.connect(redis_server.url, prefix=prefix)


async def _write_layout_2(raw, keys: Keys) -> tuple[TenantRecord, list[SessionRecord]]:
    """Data as chatsvc wrote it at schema version 2: token ids inside the session record."""
    tenant = TenantRecord(
        id="t2", name="old", api_key_hash="1" * 64, cache_salt=b"s" * 32, created_at=1.0
    )
    await raw.set(keys.tenant(tenant.id), encode(tenant))
    sessions = []
    for n in range(3):
        session = SessionRecord(
            id=f"v2s{n}",
            tenant_id=tenant.id,
            system_prompt_id=None,
            metadata={"n": str(n)},
            created_at=1.0,
            updated_at=10.0 + n,
            num_messages=1,
            token_ids=list(range(n * 100)),
        )
        await raw.set(keys.session(session.id), encode(session))
        message = MessageRecord(role="system", text=f"sys {n}", token_ids=[n], created_at=1.0)
        await raw.rpush(keys.session_messages(session.id), encode(message))
        await raw.zadd(keys.tenant_sessions(tenant.id), {session.id: session.updated_at})
        sessions.append(session)
    await raw.pexpire(keys.session(sessions[1].id), 600_000)  # an idle TTL running
    await raw.set(keys.session_lock(sessions[2].id), "a-turn-in-flight")  # not a session key
    await raw.set(keys.schema_version(), 2)
    return tenant, sessions


async def test_layout_2_token_histories_move_to_their_own_key(redis_server, prefix, raw):
    keys = Keys(prefix)
    tenant, sessions = await _write_layout_2(raw, keys)

    store = await Store.connect(redis_server.url, prefix=prefix)
    try:
        assert await raw.get(keys.schema_version()) == str(SCHEMA_VERSION).encode()
        for session in sessions:
            summary = decode(SessionSummary, await raw.get(keys.session(session.id)))
            assert _before_layout_5(summary) == session.summary()
            tokens = await raw.get(keys.session_tokens(session.id))
            assert tokens == encode_tokens(session.token_ids)
            assert b"token_ids" not in await raw.get(keys.session(session.id))
            assert _before_layout_5(await store.sessions.get(tenant.id, session.id)) == session
        assert 0 < await raw.pttl(keys.session_tokens(sessions[1].id)) <= 600_000
        assert 0 < await raw.pttl(keys.session(sessions[1].id)) <= 600_000
        assert await raw.pttl(keys.session_tokens(sessions[0].id)) == -1
        assert await raw.get(keys.session_lock(sessions[2].id)) == b"a-turn-in-flight"
        listed, _ = await store.sessions.list_page(tenant.id)
        assert [s.num_tokens for s in listed] == [200, 100, 0]
        async with store.sessions.turn_lock(tenant.id, sessions[0].id) as lock:
            user = MessageRecord(role="user", text="u", token_ids=[7])
            assistant = MessageRecord(role="assistant", text="a", token_ids=[8])
            await commit_after(store, tenant.id, sessions[0].id, user, assistant, lock=lock)
        assert (await store.sessions.get(tenant.id, sessions[0].id)).token_ids == [7, 8]
    finally:
        await store.close()


async def test_token_history_migration_is_idempotent(redis_server, prefix, raw):
    keys = Keys(prefix)
    _, sessions = await _write_layout_2(raw, keys)
    await m0004_session_tokens_key.up(raw, keys)
    once = {k: await raw.dump(k) async for k in raw.scan_iter(match=f"{prefix}:session:*")}
    await m0004_session_tokens_key.up(raw, keys)
    again = {k: await raw.dump(k) async for k in raw.scan_iter(match=f"{prefix}:session:*")}
    assert again == once
    tokens = await raw.get(keys.session_tokens(sessions[2].id))
    assert decode_tokens(tokens) == sessions[2].token_ids


async def _write_layout_4(raw, keys: Keys) -> tuple[TenantRecord, list[list[MessageRecord]]]:
    """Data as chatsvc wrote it at schema version 4: one message list per session, the
    token history in its own key. Session v4s1's second user message was rendered
    again from the start (its ids are the whole prompt), as ChatFormat.extend does
    when the template does not extend the stored history."""
    tenant = TenantRecord(id="t4", name="old4", cache_salt=b"s" * 32, created_at=1.0)
    await raw.set(keys.tenant(tenant.id), encode(tenant))
    sys = MessageRecord(role="system", text="sys", token_ids=[1, 2], created_at=1.0)
    u1 = MessageRecord(role="user", text="u1", token_ids=[3], created_at=2.0)
    a1 = MessageRecord(role="assistant", text="a1", token_ids=[4, 5], created_at=3.0)
    u2 = MessageRecord(role="user", text="u2", token_ids=[1, 2, 3, 4, 9, 6], created_at=4.0)
    a2 = MessageRecord(role="assistant", text="a2", token_ids=[7], created_at=5.0)
    conversations = [[sys, u1, a1], [sys, u1, a1, u2, a2], []]
    histories = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 6, 7], []]
    for n, (messages, history) in enumerate(zip(conversations, histories, strict=True)):
        sid = f"v4s{n}"
        summary = SessionSummary(
            id=sid,
            tenant_id=tenant.id,
            system_prompt_id=None,
            metadata={},
            created_at=1.0,
            updated_at=10.0 + n,
            num_messages=len(messages),
            num_tokens=len(history),
        )
        await raw.set(keys.session(sid), encode(summary))
        await raw.set(keys.session_tokens(sid), encode_tokens(history))
        for message in messages:
            await raw.rpush(keys.session_messages(sid), encode(message))
        await raw.zadd(keys.tenant_sessions(tenant.id), {sid: summary.updated_at})
    await raw.pexpire(keys.session("v4s1"), 600_000)
    await raw.set(keys.schema_version(), 4)
    return tenant, conversations


async def test_layout_4_message_lists_become_trees(redis_server, prefix, raw):
    keys = Keys(prefix)
    tenant, conversations = await _write_layout_4(raw, keys)

    store = await Store.connect(redis_server.url, prefix=prefix)
    try:
        assert await raw.get(keys.schema_version()) == str(SCHEMA_VERSION).encode()
        for n, old in enumerate(conversations):
            sid = f"v4s{n}"
            assert await raw.exists(keys.session_messages(sid)) == 0
            messages = await store.tree.messages(tenant.id, sid)
            assert [(m.role, m.text, m.token_ids) for m in messages] == [
                (m.role, m.text, m.token_ids) for m in old
            ]
            assert all(m.id.startswith("msg_") for m in messages)
            parents = [None, *(m.id for m in messages)][: len(messages)]
            assert [m.parent_id for m in messages] == parents
            session = await store.sessions.get(tenant.id, sid)
            assert session.active_leaf == (messages[-1].id if messages else None)
            assert session.num_nodes == session.num_messages == len(old)
        restarted = await store.tree.messages(tenant.id, "v4s1")
        assert [m.from_start for m in restarted] == [False, False, False, True, False]
        branch = await store.tree.branch(tenant.id, "v4s1")
        assert branch.tokens() == [1, 2, 3, 4, 9, 6, 7]
        assert 0 < await raw.pttl(keys.session_nodes("v4s1")) <= 600_000

        # The old conversation goes on in the new layout: a regenerated answer to u1
        # continues exactly u1's tokens and becomes a sibling of a1.
        u1 = restarted[1]
        async with store.sessions.turn_lock(tenant.id, "v4s1") as lock:
            answer = MessageRecord(role="assistant", text="a1'", token_ids=[8])
            await store.branches.commit_turn(
                tenant.id,
                "v4s1",
                parent_id=u1.id,
                inputs=[],
                output=answer,
                prompt_token_ids=[1, 2, 3],
                lock=lock,
            )
        branch = await store.tree.branch(tenant.id, "v4s1")
        assert [m.text for m in branch.messages] == ["sys", "u1", "a1'"]
        assert branch.siblings[2] == [restarted[2].id, branch.messages[2].id]
        assert (await store.sessions.get(tenant.id, "v4s1")).token_ids == [1, 2, 3, 8]
    finally:
        await store.close()


async def test_message_tree_migration_is_idempotent(redis_server, prefix, raw):
    keys = Keys(prefix)
    await _write_layout_4(raw, keys)
    await m0005_message_tree.up(raw, keys)
    once = {k: await raw.dump(k) async for k in raw.scan_iter(match=f"{prefix}:session:*")}
    await m0005_message_tree.up(raw, keys)
    again = {k: await raw.dump(k) async for k in raw.scan_iter(match=f"{prefix}:session:*")}
    assert again == once


async def test_layout_5_sessions_get_their_byte_counts(redis_server, prefix, raw):
    """Migration 0006 measures what sessions written before the counters store: the
    counts it leaves equal those the writes keep, and a second run changes nothing."""
    keys = Keys(prefix)
    store = await Store.connect(redis_server.url, prefix=prefix)
    try:
        tenant = await store.tenants.ensure("bytes")
        items = [MessageRecord(role="user", text="x" * n, token_ids=[]) for n in (10, 300)]
        for n in range(3):
            await store.sessions.create(tenant.id, None, "sys", [1] * n, {}, messages=items[:n])
        kept = await raw.hgetall(keys.tenant_bytes(tenant.id))
    finally:
        await store.close()
    await raw.delete(keys.tenant_bytes(tenant.id))
    await raw.set(keys.schema_version(), 5)
    store = await Store.connect(redis_server.url, prefix=prefix)
    await store.close()
    assert await raw.hgetall(keys.tenant_bytes(tenant.id)) == kept
    await m0006_storage_bytes.up(raw, keys)
    assert await raw.hgetall(keys.tenant_bytes(tenant.id)) == kept
