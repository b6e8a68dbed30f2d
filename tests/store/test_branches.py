"""Branching in the store: a real Redis, every write fenced, idempotent and atomic.

The token ids are small made-up numbers so each assertion says exactly which
message's tokens a history holds.
"""

from __future__ import annotations

import pytest

from chatsvc.store import Store, TurnLockLostError
from chatsvc.store.errors import LimitExceededError, NotFoundError
from chatsvc.store.records import MessageRecord, ResponseRecord, Usage
from chatsvc.store.responses import new_response_id
from chatsvc.store.tree import new_message_id
from tests.store.helpers import new_tenant

pytestmark = pytest.mark.anyio


def _user(text: str) -> MessageRecord:
    return MessageRecord(role="user", text=text, token_ids=[])


def _answer(text: str, ids: list[int]) -> MessageRecord:
    usage = Usage(prompt_tokens=1, cached_tokens=0, completion_tokens=len(ids))
    return MessageRecord(role="assistant", text=text, token_ids=ids, usage=usage)


async def _turn(store, tenant, sid, parent, inputs, answer, prompt, **kwargs):
    async with store.sessions.turn_lock(tenant.id, sid) as lock:
        return await store.branches.commit_turn(
            tenant.id,
            sid,
            parent_id=parent,
            inputs=inputs,
            output=answer,
            prompt_token_ids=prompt,
            lock=lock,
            **kwargs,
        )


async def _texts(store, tenant, sid, leaf=None) -> list[str]:
    return [m.text for m in (await store.tree.branch(tenant.id, sid, leaf)).messages]


@pytest.fixture
async def chat(store: Store):
    """sys -> u1 -> a1 -> u2 -> a2, with token histories [1] [1 2] [1 2 3] [1 2 3 4] [.. 5]."""
    tenant = await new_tenant(store)
    session = await store.sessions.create(tenant.id, None, "sys", [1], {})
    sys_id = session.active_leaf
    t1 = await _turn(store, tenant, session.id, sys_id, [_user("u1")], _answer("a1", [3]), [1, 2])
    u1, a1 = t1.messages
    t2 = await _turn(
        store, tenant, session.id, a1.id, [_user("u2")], _answer("a2", [5]), [1, 2, 3, 4]
    )
    u2, a2 = t2.messages
    return (
        store,
        tenant,
        session.id,
        {"sys": sys_id, "u1": u1.id, "a1": a1.id, "u2": u2.id, "a2": a2.id},
    )


async def test_turns_store_each_message_with_only_its_new_tokens(chat, raw):
    store, tenant, sid, ids = chat
    messages = await store.tree.messages(tenant.id, sid)
    assert [(m.text, m.token_ids) for m in messages] == [
        ("sys", [1]),
        ("u1", [2]),
        ("a1", [3]),
        ("u2", [4]),
        ("a2", [5]),
    ]
    assert [m.parent_id for m in messages] == [None, ids["sys"], ids["u1"], ids["a1"], ids["u2"]]
    session = await store.sessions.get(tenant.id, sid)
    assert session.token_ids == [1, 2, 3, 4, 5]
    assert session.active_leaf == ids["a2"] and session.num_messages == session.num_nodes == 5
    assert await raw.hlen(store.keys.session_nodes(sid)) == 5


async def test_a_regenerated_answer_is_a_sibling_and_continues_the_user_tokens(chat, raw):
    store, tenant, sid, ids = chat
    again = await _turn(store, tenant, sid, ids["u2"], [], _answer("a2'", [6]), [1, 2, 3, 4])
    (regenerated,) = again.messages
    assert regenerated.token_ids == [6] and not regenerated.from_start
    branch = await store.tree.branch(tenant.id, sid)
    assert [m.text for m in branch.messages] == ["sys", "u1", "a1", "u2", "a2'"]
    assert branch.siblings[4] == [ids["a2"], regenerated.id]
    assert branch.siblings[3] == [ids["u2"]]
    assert (await store.sessions.get(tenant.id, sid)).token_ids == [1, 2, 3, 4, 6]
    # The shared history is stored once; the old answer is kept as a version.
    assert await raw.hlen(store.keys.session_nodes(sid)) == 6
    assert await _texts(store, tenant, sid, ids["a2"]) == ["sys", "u1", "a1", "u2", "a2"]


async def test_an_edit_branches_and_switching_restores_every_branch(chat):
    store, tenant, sid, ids = chat
    edit = await _turn(
        store, tenant, sid, ids["a1"], [_user("u2 edited")], _answer("b2", [8]), [1, 2, 3, 7]
    )
    assert await _texts(store, tenant, sid) == ["sys", "u1", "a1", "u2 edited", "b2"]
    assert (await store.sessions.get(tenant.id, sid)).token_ids == [1, 2, 3, 7, 8]
    branch = await store.tree.branch(tenant.id, sid)
    assert branch.siblings[3] == [ids["u2"], edit.messages[0].id]

    async with store.sessions.turn_lock(tenant.id, sid) as lock:
        switched = await store.branches.switch(tenant.id, sid, ids["u2"], lock=lock)
    assert switched.session.active_leaf == ids["a2"]
    assert await _texts(store, tenant, sid) == ["sys", "u1", "a1", "u2", "a2"]
    assert (await store.sessions.get(tenant.id, sid)).token_ids == [1, 2, 3, 4, 5]

    # Switching to a message with several continuations follows the newest one.
    async with store.sessions.turn_lock(tenant.id, sid) as lock:
        await store.branches.switch(tenant.id, sid, ids["a1"], lock=lock)
    assert await _texts(store, tenant, sid) == ["sys", "u1", "a1", "u2 edited", "b2"]
    async with store.sessions.turn_lock(tenant.id, sid) as lock:
        with pytest.raises(NotFoundError):
            await store.branches.switch(tenant.id, sid, new_message_id(), lock=lock)


async def test_a_prompt_that_does_not_extend_the_history_starts_over(chat):
    store, tenant, sid, ids = chat
    redone = await _turn(
        store, tenant, sid, ids["a2"], [_user("u3")], _answer("a3", [9]), [1, 20, 3, 4, 5, 6]
    )
    user, _ = redone.messages
    assert user.from_start and user.token_ids == [1, 20, 3, 4, 5, 6]
    branch = await store.tree.branch(tenant.id, sid, redone.messages[-1].id)
    assert branch.tokens() == [1, 20, 3, 4, 5, 6, 9]
    assert (await store.sessions.get(tenant.id, sid)).token_ids == [1, 20, 3, 4, 5, 6, 9]


async def test_deleting_a_branch_removes_only_what_no_other_branch_uses(chat, raw):
    store, tenant, sid, ids = chat
    edit = await _turn(
        store, tenant, sid, ids["a1"], [_user("u2'")], _answer("b2", [8]), [1, 2, 3, 7]
    )
    async with store.sessions.turn_lock(tenant.id, sid) as lock:
        await store.branches.delete(tenant.id, sid, edit.messages[0].id, lock=lock)
    # The edit's two messages went; the shared head and the other branch stay, and
    # the active branch moved to what is left below a1.
    assert await raw.hlen(store.keys.session_nodes(sid)) == 5
    assert await _texts(store, tenant, sid) == ["sys", "u1", "a1", "u2", "a2"]
    session = await store.sessions.get(tenant.id, sid)
    assert session.token_ids == [1, 2, 3, 4, 5] and session.num_nodes == 5
    with pytest.raises(NotFoundError):
        await store.tree.branch(tenant.id, sid, edit.messages[1].id)

    async with store.sessions.turn_lock(tenant.id, sid) as lock:
        await store.branches.delete(tenant.id, sid, ids["u1"], lock=lock)
    assert await _texts(store, tenant, sid) == ["sys"]
    assert (await store.sessions.get(tenant.id, sid)).token_ids == [1]
    assert await raw.hkeys(store.keys.session_children(sid)) == [b"root"]


async def test_deleting_one_item_keeps_what_follows_and_drops_its_tokens(chat):
    store, tenant, sid, ids = chat
    async with store.sessions.turn_lock(tenant.id, sid) as lock:
        await store.branches.delete_message(tenant.id, sid, ids["a1"], lock=lock)
    branch = await store.tree.branch(tenant.id, sid)
    assert [m.text for m in branch.messages] == ["sys", "u1", "u2", "a2"]
    assert [m.parent_id for m in branch.messages][2] == ids["u1"]
    # What came after the removed text was rendered after it: those ids are gone,
    # and the history is what is still valid (the next turn renders the rest).
    assert [m.token_ids for m in branch.messages] == [[1], [2], [], []]
    assert (await store.sessions.get(tenant.id, sid)).token_ids == [1, 2]


async def test_items_hold_no_tokens_until_a_turn_renders_them(store: Store):
    tenant = await new_tenant(store)
    session = await store.sessions.create(
        tenant.id, None, None, None, {}, messages=[_user("hi")], kind="conversation"
    )
    async with store.sessions.turn_lock(tenant.id, session.id) as lock:
        await store.branches.add_messages(
            tenant.id,
            session.id,
            [MessageRecord(role="assistant", text="yo", token_ids=[99])],
            lock=lock,
        )
    branch = await store.tree.branch(tenant.id, session.id)
    assert [(m.role, m.token_ids) for m in branch.messages] == [("user", []), ("assistant", [])]
    done = await _turn(
        store, tenant, session.id, branch.leaf_id, [_user("next")], _answer("a", [4]), [1, 2, 3]
    )
    assert done.messages[0].token_ids == [1, 2, 3]
    assert (await store.sessions.get(tenant.id, session.id)).token_ids == [1, 2, 3, 4]


async def test_a_turn_is_fenced_idempotent_and_bounded(chat, raw):
    store, tenant, sid, ids = chat
    before = await raw.hgetall(store.keys.session_nodes(sid))
    async with store.sessions.turn_lock(tenant.id, sid) as lock:
        await raw.delete(store.keys.session_lock(sid))
        with pytest.raises(TurnLockLostError):
            await store.branches.commit_turn(
                tenant.id,
                sid,
                parent_id=ids["a2"],
                inputs=[_user("x")],
                output=_answer("y", [1]),
                prompt_token_ids=[1],
                lock=lock,
            )
    with pytest.raises(LimitExceededError):
        await _turn(
            store, tenant, sid, ids["a2"], [_user("x")], _answer("y", [1]), [1], max_nodes=6
        )
    assert await raw.hgetall(store.keys.session_nodes(sid)) == before

    user, answer = _user("x"), _answer("y", [6])
    first = await _turn(
        store, tenant, sid, ids["a2"], [user], answer, [1, 2, 3, 4, 5], turn_id="t-1"
    )
    again = await _turn(
        store,
        tenant,
        sid,
        ids["a2"],
        [first.messages[0]],
        first.messages[1],
        [1, 2, 3, 4, 5],
        turn_id="t-1",
    )
    assert again is None  # already applied: nothing written twice
    assert await raw.hlen(store.keys.session_nodes(sid)) == 7


async def test_responses_live_in_their_session_and_go_with_what_only_they_use(store: Store, raw):
    tenant = await new_tenant(store)
    other = await new_tenant(store)
    sid = "f" * 32
    u1, a1 = _user("q1"), _answer("r1", [2])
    u1.id, a1.id = new_message_id(), new_message_id()
    first = ResponseRecord(
        id=new_response_id(sid),
        session_id=sid,
        created_at=1.0,
        completed_at=1.0,
        model="m",
        status="completed",
        input_ids=[u1.id],
        output_id=a1.id,
    )
    await store.sessions.create(
        tenant.id,
        None,
        None,
        None,
        {},
        messages=[u1, a1],
        kind="response",
        response=first,
        session_id=sid,
    )
    assert (await store.responses.get(tenant.id, first.id)) == first
    assert await store.responses.get(other.id, first.id) is None
    assert await store.responses.get(tenant.id, new_response_id(sid)) is None

    u2, a2 = _user("q2"), _answer("r2", [4])
    u2.id, a2.id = new_message_id(), new_message_id()
    second = ResponseRecord(
        id=new_response_id(sid),
        session_id=sid,
        created_at=2.0,
        completed_at=2.0,
        model="m",
        status="completed",
        input_ids=[u2.id],
        output_id=a2.id,
        previous_response_id=first.id,
    )
    await _turn(store, tenant, sid, a1.id, [u2], a2, [1, 2, 3], response=second)

    # The first response's messages carry the second: only its record goes.
    async with store.sessions.turn_lock(tenant.id, sid) as lock:
        await store.responses.delete(tenant.id, first.id, lock=lock)
    assert await store.responses.get(tenant.id, first.id) is None
    assert await raw.hlen(store.keys.session_nodes(sid)) == 4

    # A branch from the first response's input (a regenerated answer): deleting the
    # second response then takes its own two messages and the first's answer, which
    # only it still carried; the first's input stays, the new answer uses it.
    other_answer = _answer("r1'", [5])
    await _turn(store, tenant, sid, u1.id, [], other_answer, [1])
    async with store.sessions.turn_lock(tenant.id, sid) as lock:
        await store.responses.delete(tenant.id, second.id, lock=lock)
    assert await raw.hlen(store.keys.session_nodes(sid)) == 2
    assert await _texts(store, tenant, sid) == ["q1", "r1'"]

    # A session made by responses goes whole with its last response and message.
    lone = await new_tenant(store)
    lone_sid = "e" * 32
    u, a = _user("q"), _answer("r", [2])
    u.id, a.id = new_message_id(), new_message_id()
    only = ResponseRecord(
        id=new_response_id(lone_sid),
        session_id=lone_sid,
        created_at=1.0,
        completed_at=1.0,
        model="m",
        status="completed",
        input_ids=[u.id],
        output_id=a.id,
    )
    await store.sessions.create(
        lone.id,
        None,
        None,
        None,
        {},
        messages=[u, a],
        kind="response",
        response=only,
        session_id=lone_sid,
    )
    async with store.sessions.turn_lock(lone.id, lone_sid) as lock:
        await store.responses.delete(lone.id, only.id, lock=lock)
    assert [k async for k in raw.scan_iter(match=f"{store.keys.prefix}:*{lone_sid}*")] == []
    assert lone_sid.encode() not in await raw.zrange(store.keys.tenant_sessions(lone.id), 0, -1)


async def test_branch_histories_lists_every_branch_the_active_one_first(chat, raw):
    store, tenant, sid, ids = chat
    await _turn(store, tenant, sid, ids["u2"], [], _answer("a2'", [6]), [1, 2, 3, 4])
    await _turn(store, tenant, sid, ids["a1"], [_user("u2''")], _answer("a3", [8]), [1, 2, 3, 7])
    ttl = await raw.pttl(store.keys.session(sid))
    histories = await store.tree.histories(tenant.id, sid)
    assert histories[0] == [1, 2, 3, 7, 8]  # the active branch: the edit
    assert sorted(histories[1:]) == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]]
    assert await raw.pttl(store.keys.session(sid)) <= ttl  # a read for deleting: no refresh
    other = await new_tenant(store)
    assert await store.tree.histories(other.id, sid) is None  # another tenant's session
