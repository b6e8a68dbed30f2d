"""Crash safety, short form of ``python -m bench.reliability.crash_loop``: 3 SIGKILLs mid-stream.

The service runs as a child process on one embedded Redis (AOF, fsync always)
that outlives it. After every kill Redis is checked against what the clients
saw: every acknowledged turn (a ``done`` event) is stored word for word, each
session's messages are user/assistant pairs whose token ids concatenate to the
session's token history, and after the last restart every conversation takes
one more turn.
"""

from __future__ import annotations

import pytest

from bench.reliability.crash_loop import parse_args, run
from bench.reliability.history import Attempt, ConversationLog, verify
from chatsvc.store import Store
from chatsvc.store.presence import ALIVE_TTL_S
from chatsvc.store.records import MessageRecord, decode_tokens, encode_tokens
from tests.redis_server import unique_prefix

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def test_three_kills_mid_stream_lose_no_acknowledged_turn(tmp_path):
    # The default turn-lock TTL (30 s): a killed turn's lock is taken over once the killed
    # instance's presence key lapses (chatsvc/store/presence.py), not after the TTL.
    args = parse_args(["--kills", "3", "--conversations", "3", "--seed", "7"])
    assert args.turn_lock_ttl_s == 30
    report = await run(args, tmp_path)
    print(report.summary())
    assert report.problems == []
    assert max(report.busy_wait_s, default=0.0) <= ALIVE_TTL_S
    assert report.kills == 3
    # The kills really landed mid-generation, and the loop did real work around them.
    assert sum(report.streams_mid_generation_at_kill) >= 3
    assert report.acknowledged >= 3  # 3 final turns at least, each checked in Redis
    assert report.sessions >= 3


async def test_the_checker_flags_lost_extra_and_torn_turns(redis_server):
    """The crash loop's verdicts are only worth something if the checker can fail."""
    store = await Store.connect(redis_server.url, prefix=unique_prefix("crashcheck"))
    try:
        tenant = await store.tenants.ensure("checker")
        system = [1, 2, 3]
        session = await store.sessions.create(tenant.id, None, "Be brief.", system, {})

        async def add(user_text: str, answer: str, user_ids: list[int], answer_ids: list[int]):
            async with store.sessions.turn_lock(tenant.id, session.id) as lock:
                before = await store.sessions.peek(tenant.id, session.id)
                await store.branches.commit_turn(
                    tenant.id,
                    session.id,
                    parent_id=before.active_leaf,
                    inputs=[MessageRecord(role="user", text=user_text, token_ids=user_ids)],
                    output=MessageRecord(role="assistant", text=answer, token_ids=answer_ids),
                    prompt_token_ids=[*before.token_ids, *user_ids],
                    lock=lock,
                )

        await add("u1", "a1", [4, 5], [6])
        await add("u2", "a2", [7], [8, 9])
        good = ConversationLog(session.id, [Attempt("u1", "a1"), Attempt("u2", "a2")])
        assert (await verify(store, tenant.id, good)).problems == []
        # The second turn was in flight (never acknowledged) yet committed: allowed.
        in_flight = ConversationLog(session.id, [Attempt("u1", "a1"), Attempt("u2")])
        verdict = await verify(store, tenant.id, in_flight)
        assert verdict.problems == [] and verdict.committed_unacknowledged == 1
        # An acknowledged turn that is not stored, or stored differently, is a loss.
        lost = ConversationLog(session.id, [*good.attempts, Attempt("u3", "a3")])
        assert (await verify(store, tenant.id, lost)).problems
        altered = ConversationLog(session.id, [Attempt("u1", "a1"), Attempt("u2", "other")])
        assert (await verify(store, tenant.id, altered)).problems
        # A stored turn the client never sent.
        unsent = ConversationLog(session.id, good.attempts[:1])
        assert (await verify(store, tenant.id, unsent)).problems
        # A torn token history: the record no longer matches its messages.
        key = store.keys.session_tokens(session.id)
        tokens = decode_tokens(await store.redis.get(key))
        await store.redis.set(key, encode_tokens(tokens[:-1]))
        assert any("concatenate" in p for p in (await verify(store, tenant.id, good)).problems)
    finally:
        await store.close()
