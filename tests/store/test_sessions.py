from __future__ import annotations

import asyncio

import pytest

from chatsvc.store import NotFoundError, Store
from chatsvc.store.listing import summary_size
from tests.store.helpers import append, commit_after, new_tenant, turn

pytestmark = pytest.mark.anyio


async def test_create_get_and_messages(store: Store):
    tenant = await new_tenant(store)
    prompt = await store.prompts.create(tenant.id, "p", "Be brief.", [5, 6], False)
    session = await store.sessions.create(
        tenant.id, prompt.id, "Be brief.", [5, 6], {"client": "web"}
    )
    assert session.token_ids == [5, 6] and session.num_messages == 1
    assert await store.sessions.get(tenant.id, session.id) == session

    messages = await store.tree.messages(tenant.id, session.id)
    assert [(m.role, m.text, m.token_ids) for m in messages] == [("system", "Be brief.", [5, 6])]


async def test_session_without_system_message(store: Store):
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, None, None, None)
    assert session.num_messages == 0 and session.token_ids == [] and session.metadata == {}
    assert await store.tree.messages(tenant.id, session.id) == []


async def test_bad_session_input_raises_and_writes_nothing(store: Store, raw, prefix):
    tenant = await new_tenant(store)
    other = await new_tenant(store)
    private = await store.prompts.create(other.id, "p", "x", [1], False)
    before = sorted([k async for k in raw.scan_iter(match=f"{prefix}:*")])
    with pytest.raises(TypeError, match="metadata"):
        await store.sessions.create(tenant.id, None, None, None, {"k": 1})
    with pytest.raises(NotFoundError, match="system prompt"):
        await store.sessions.create(tenant.id, private.id, "x", [1], {})
    with pytest.raises(NotFoundError, match="tenant"):
        await store.sessions.create("f" * 32, None, None, None, {})
    with pytest.raises(ValueError, match="malformed"):
        await store.sessions.get(tenant.id, "a:b*")
    assert sorted([k async for k in raw.scan_iter(match=f"{prefix}:*")]) == before


async def test_other_tenant_cannot_see_or_touch_a_session(store: Store):
    a = await new_tenant(store, "a")
    b = await new_tenant(store, "b")
    session = await store.sessions.create(a.id, None, "sys", [1], {})
    user, assistant = turn(1)

    assert await store.sessions.get(b.id, session.id) is None
    assert await store.tree.messages(b.id, session.id) is None
    assert await store.sessions.delete(b.id, session.id) is False
    with pytest.raises(NotFoundError):
        await append(store, b.id, session.id, user, assistant)
    async with store.sessions.turn_lock(a.id, session.id) as lock:
        # Even with A's own lock in hand, B's commit is refused like an unknown id.
        with pytest.raises(NotFoundError):
            await commit_after(store, b.id, session.id, user, assistant, lock=lock)
    with pytest.raises(NotFoundError):
        async with store.sessions.turn_lock(b.id, session.id):
            pass
    # Same answers as for an id that exists nowhere.
    unknown = "0123456789abcdef0123456789abcdef"
    assert await store.sessions.get(b.id, unknown) is None
    assert await store.sessions.delete(b.id, unknown) is False
    assert (await store.sessions.list_page(b.id))[0] == []
    # And A's session is untouched.
    assert (await store.sessions.get(a.id, session.id)).num_messages == 1


async def test_list_sessions_newest_first_with_cursor(store: Store):
    a = await new_tenant(store, "a")
    b = await new_tenant(store, "b")
    ids = [(await store.sessions.create(a.id, None, None, None, {})).id for _ in range(7)]
    await store.sessions.create(b.id, None, None, None, {})
    # Touching the oldest session with a turn moves it to the front.
    await append(store, a.id, ids[0], *turn(1))
    expected = [ids[0], *reversed(ids[1:])]

    seen, cursor = [], None
    while True:
        page, cursor = await store.sessions.list_page(a.id, limit=3, cursor=cursor)
        assert len(page) <= 3
        seen += [s.id for s in page]
        if cursor is None:
            break
    assert seen == expected
    assert await store.sessions.count(a.id) == 7 and await store.sessions.count(b.id) == 1

    with pytest.raises(ValueError, match="cursor"):
        await store.sessions.list_page(a.id, cursor="garbage")
    with pytest.raises(ValueError, match="limit"):
        await store.sessions.list_page(a.id, limit=0)


async def test_list_pagination_survives_equal_timestamps(store: Store, raw, prefix):
    a = await new_tenant(store)
    ids = [(await store.sessions.create(a.id, None, None, None, {})).id for _ in range(5)]
    # Force a tie on the score: keyset pagination must still visit each id once.
    await raw.zadd(f"{prefix}:tenant:{a.id}:sessions", {sid: 42.0 for sid in ids})
    seen, cursor = [], None
    while True:
        page, cursor = await store.sessions.list_page(a.id, limit=2, cursor=cursor)
        seen += [s.id for s in page]
        if cursor is None:
            break
    assert seen == sorted(ids, reverse=True)


async def test_delete_removes_every_key_of_the_session(store: Store, raw, prefix):
    tenant = await new_tenant(store)
    keep = await store.sessions.create(tenant.id, None, "sys", [1], {})
    gone = await store.sessions.create(tenant.id, None, "sys", [1], {})
    await append(store, tenant.id, gone.id, *turn(1))
    async with store.sessions.turn_lock(tenant.id, gone.id):
        assert await store.sessions.delete(tenant.id, gone.id) is True

    leftovers = [k async for k in raw.scan_iter(match=f"{prefix}:*{gone.id}*")]
    assert leftovers == []
    index = await raw.zrange(f"{prefix}:tenant:{tenant.id}:sessions", 0, -1)
    assert index == [keep.id.encode()]
    assert await store.sessions.get(tenant.id, gone.id) is None
    assert await store.sessions.delete(tenant.id, gone.id) is False
    assert await store.sessions.get(tenant.id, keep.id) is not None


async def test_idle_ttl_expires_sessions_and_listing_prunes_them(redis_server, prefix, raw):
    store = await Store.connect(redis_server.url, prefix=prefix, session_ttl_s=1.0)
    try:
        tenant = await new_tenant(store)
        idle = await store.sessions.create(tenant.id, None, "sys", [1], {})
        active = await store.sessions.create(tenant.id, None, "sys", [1], {})
        for key in (f"{prefix}:session:{{{idle.id}}}", f"{prefix}:session:{{{idle.id}}}:nodes"):
            assert 0 < await raw.pttl(key) <= 1000

        # Keep one session in use (a turn every 0.25 s, well inside its 1 s TTL)
        # while the other sits idle for 1.5 s, past its TTL.
        for n in range(6):
            await asyncio.sleep(0.25)
            await append(store, tenant.id, active.id, *turn(n))
        assert await store.sessions.get(tenant.id, idle.id) is None
        assert await raw.exists(f"{prefix}:session:{{{idle.id}}}:nodes") == 0

        page, cursor = await store.sessions.list_page(tenant.id)
        assert [s.id for s in page] == [active.id] and cursor is None
        index = await raw.zrange(f"{prefix}:tenant:{tenant.id}:sessions", 0, -1)
        assert index == [active.id.encode()]
        assert len(await store.tree.messages(tenant.id, active.id)) == 13
    finally:
        await store.close()


async def test_listing_returns_summaries_and_never_reads_token_histories(store: Store, raw):
    tenant = await new_tenant(store)
    long_history = list(range(5000))
    ids = [
        (await store.sessions.create(tenant.id, None, "sys", long_history, {"n": str(n)})).id
        for n in range(3)
    ]
    # Token histories the listing would choke on, were it to read them.
    for sid in ids:
        await raw.set(store.keys.session_tokens(sid), b"\xc1 not msgpack")
    page, cursor = await store.sessions.list_page(tenant.id)
    assert [s.id for s in page] == ids[::-1] and cursor is None
    assert all(not hasattr(s, "token_ids") and s.num_tokens == 5000 for s in page)
    assert [s.metadata for s in page] == [{"n": "2"}, {"n": "1"}, {"n": "0"}]


async def test_a_page_ends_early_at_its_byte_budget_and_paging_sees_each_once(store: Store):
    tenant = await new_tenant(store)
    big = {f"k{i}": "x" * 4000 for i in range(4)}  # ~16 KB of metadata per session
    ids = [(await store.sessions.create(tenant.id, None, None, None, big)).id for _ in range(10)]
    budget = 40_000  # two of them fit, a third does not
    seen, pages, cursor = [], [], None
    while True:
        page, cursor = await store.sessions.list_page(
            tenant.id, limit=100, cursor=cursor, max_bytes=budget
        )
        pages.append(page)
        seen += [s.id for s in page]
        if cursor is None:
            break
    assert seen == ids[::-1]
    assert [len(p) for p in pages] == [2, 2, 2, 2, 2]
    assert all(sum(summary_size(s) for s in p) <= budget for p in pages)
    # A summary bigger than the whole budget still comes, alone, so paging advances.
    page, cursor = await store.sessions.list_page(tenant.id, limit=100, max_bytes=10)
    assert [s.id for s in page] == [ids[-1]] and cursor is not None
    with pytest.raises(ValueError, match="max_bytes"):
        await store.sessions.list_page(tenant.id, max_bytes=0)


async def test_concurrent_creates_never_pass_the_tenant_cap(store: Store):
    # Counted first and created after, each of a burst saw room and all passed the cap.
    from chatsvc.store.errors import LimitExceededError

    tenant = await new_tenant(store)
    cap = 5

    async def create():
        try:
            await store.sessions.create(tenant.id, None, None, None, None, max_sessions=cap)
        except LimitExceededError:
            return False
        return True

    created = await asyncio.gather(*(create() for _ in range(12)))
    assert sum(created) == cap
    assert await store.sessions.count(tenant.id) == cap
    page, _ = await store.sessions.list_page(tenant.id)
    assert len(page) == cap


async def test_only_a_malformed_id_is_a_malformed_id_error(store: Store):
    # The API answers a malformed id as an unknown one (404) and other bad input as 400.
    from chatsvc.store.errors import InvalidInputError, MalformedIdError

    tenant = await new_tenant(store)
    with pytest.raises(MalformedIdError):
        await store.sessions.get(tenant.id, "not/an id")
    too_many = {f"k{i}": "v" for i in range(65)}
    with pytest.raises(InvalidInputError) as info:
        await store.sessions.create(tenant.id, None, None, None, too_many)
    assert not isinstance(info.value, MalformedIdError)
