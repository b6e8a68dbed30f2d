"""A turn whose turn lock was lost mid-generation is refused at commit: 409, nothing stored.

The fault: right before the turn commits, its lock key is taken over by
another holder, as happens when the lock expires during a stall or a Redis
failover longer than its TTL and another replica's turn takes the session.
"""

from __future__ import annotations

import json

import pytest

from chatsvc.chat_client import iter_sse
from tests.api.conftest import keyspace, new_session, say, unique

TAKEN_BY = "another-replicas-turn"


@pytest.fixture
def lock_taken_before_commit(api, monkeypatch):
    """Make every turn lose its lock to TAKEN_BY just before it commits."""
    store = api.services.store
    commit = store.branches.commit_turn

    async def taken_then_commit(tenant_id, session_id, *args, **kwargs):
        await store.redis.set(store.keys.session_lock(session_id), TAKEN_BY)
        return await commit(tenant_id, session_id, *args, **kwargs)

    monkeypatch.setattr(store.branches, "commit_turn", taken_then_commit)
    return store


def _snapshot(acme, sid: str) -> tuple[dict, dict]:
    return acme.get(f"/sessions/{sid}").json(), acme.get(f"/sessions/{sid}/messages").json()


def test_a_turn_that_lost_its_lock_gets_409_and_stores_nothing(
    api, acme, raw_redis, monkeypatch, lock_taken_before_commit
):
    store = lock_taken_before_commit
    sid = new_session(acme)["id"]
    before = _snapshot(acme, sid)
    prefix = api.services.settings.key_prefix
    keys_before = {
        k: v
        for k, v in keyspace(raw_redis, prefix).items()
        if sid.encode() in k and b":lock" not in k
    }

    body = {"content": unique("Say hello."), "max_tokens": 4, "temperature": 0}
    response = acme.post(f"/sessions/{sid}/messages", json=body)
    assert response.status_code == 409, response.text
    assert response.json()["error"]["type"] == "turn_lock_lost"
    assert "not stored" in response.json()["error"]["message"]

    # That other turn ends (its lock is freed); the next of ours loses its lock the same way.
    raw_redis.delete(store.keys.session_lock(sid))
    with acme.stream("POST", f"/sessions/{sid}/messages", json=body | {"stream": True}) as stream:
        events = list(iter_sse(stream.iter_lines()))
    assert (
        events[-1][0] == "error" and json.loads(events[-1][1])["error"]["type"] == "turn_lock_lost"
    )
    assert "done" not in [name for name, _ in events]

    # Not a byte of the session changed, and the lock stays with whoever took it.
    assert _snapshot(acme, sid) == before
    keys_after = {
        k: v
        for k, v in keyspace(raw_redis, prefix).items()
        if sid.encode() in k and b":lock" not in k
    }
    assert keys_after == keys_before
    assert raw_redis.get(store.keys.session_lock(sid)) == TAKEN_BY.encode()

    # Once that turn is over (its lock freed), the session takes turns again.
    monkeypatch.undo()
    raw_redis.delete(store.keys.session_lock(sid))
    say(acme, sid, unique("Say hi."), max_tokens=2)
    assert _snapshot(acme, sid)[0]["num_messages"] == before[0]["num_messages"] + 2
