"""Pages of the active branch: read by position, only the page's records."""

from __future__ import annotations

import pytest

from chatsvc.store import InvalidInputError, Store
from chatsvc.store.records import MessageRecord, encode
from tests.store.helpers import new_tenant

pytestmark = pytest.mark.anyio


@pytest.fixture
async def six(store: Store):
    """A session of six items m0..m5, plus an edited branch off m1 that is not active."""
    tenant = await new_tenant(store)
    items = [MessageRecord(role="user", text=f"m{i}", token_ids=[]) for i in range(6)]
    session = await store.sessions.create(tenant.id, None, None, None, {}, messages=items)
    first = await store.tree.branch(tenant.id, session.id)
    answer = MessageRecord(role="assistant", text="edit", token_ids=[7])
    async with store.sessions.turn_lock(tenant.id, session.id) as lock:
        await store.branches.commit_turn(
            tenant.id,
            session.id,
            parent_id=first.messages[1].id,
            inputs=[MessageRecord(role="user", text="x", token_ids=[])],
            output=answer,
            prompt_token_ids=[5, 6],
            lock=lock,
        )
        await store.branches.switch(tenant.id, session.id, first.messages[5].id, lock=lock)
    branch = await store.tree.branch(tenant.id, session.id)
    assert branch.ids == first.ids and len(branch.siblings[2]) == 2
    return store, tenant, session, branch


def _texts(page) -> list[str]:
    return [m.text for m in page.messages]


async def test_pages_run_in_either_order_from_a_cursor(six):
    store, tenant, session, branch = six
    page = await store.tree.page(tenant.id, session.id, limit=4)
    assert _texts(page) == ["m0", "m1", "m2", "m3"] and page.has_more and page.total == 6
    page = await store.tree.page(tenant.id, session.id, limit=4, after=page.messages[-1].id)
    assert _texts(page) == ["m4", "m5"] and not page.has_more
    page = await store.tree.page(tenant.id, session.id, limit=2, order="desc")
    assert _texts(page) == ["m5", "m4"] and page.has_more
    after = page.messages[-1].id
    page = await store.tree.page(tenant.id, session.id, limit=9, order="desc", after=after)
    assert _texts(page) == ["m3", "m2", "m1", "m0"] and not page.has_more
    last = branch.messages[-1].id
    page = await store.tree.page(tenant.id, session.id, limit=3, after=last)
    assert page.messages == [] and not page.has_more


async def test_a_page_carries_the_siblings_and_continuations_the_branch_has(six):
    store, tenant, session, branch = six
    for start in range(6):
        after = branch.messages[start - 1].id if start else None
        page = await store.tree.page(tenant.id, session.id, limit=2, after=after)
        assert page.messages == branch.messages[start : start + 2]
        assert page.siblings == branch.siblings[start : start + 2]
        assert page.continuations == branch.continuations


async def test_a_page_reads_only_its_own_records(six, raw):
    store, tenant, session, branch = six
    # Remove every record but m3's and m4's: a read of the whole branch now fails,
    # the page of m3..m4 does not, because it never reads the others.
    others = [m.id for m in branch.messages if m.text not in ("m3", "m4")]
    await raw.hdel(store.keys.session_nodes(session.id), *others)
    with pytest.raises(RuntimeError, match="does not hold"):
        await store.tree.branch(tenant.id, session.id)
    page = await store.tree.page(tenant.id, session.id, limit=2, after=branch.messages[2].id)
    assert _texts(page) == ["m3", "m4"]


async def test_bad_cursors_and_limits_are_input_errors(six):
    store, tenant, session, _ = six
    with pytest.raises(InvalidInputError, match="after names no message"):
        await store.tree.page(tenant.id, session.id, limit=2, after="msg_unknown")
    for limit in (0, 1001):
        with pytest.raises(InvalidInputError, match="limit"):
            await store.tree.page(tenant.id, session.id, limit=limit)
    other = await new_tenant(store)
    assert await store.tree.page(other.id, session.id, limit=2) is None


async def test_a_page_ends_early_at_its_byte_budget_and_paging_sees_each_once(six):
    store, tenant, session, branch = six
    size = len(encode(branch.messages[0]))
    for order in ("asc", "desc"):
        seen, after = [], None
        while True:
            page = await store.tree.page(
                tenant.id, session.id, limit=5, after=after, order=order, max_bytes=2 * size
            )
            assert 1 <= len(page.messages) <= 2
            seen += _texts(page)
            if not page.has_more:
                break
            after = page.messages[-1].id
        expected = [f"m{i}" for i in range(6)]
        assert seen == (expected if order == "asc" else expected[::-1])
    # One record larger than the budget still comes, alone, so paging advances.
    page = await store.tree.page(tenant.id, session.id, limit=5, max_bytes=1)
    assert _texts(page) == ["m0"] and page.has_more
