"""A write Redis applied but whose reply was lost is stored once: the service over a real fault.

The service talks to the real Redis through ``ReplyDroppingProxy``, which lets
one write through and cuts the connection before its reply comes back, as a
failover or a network drop does. redis-py reconnects and sends the write
again; the session must still hold each message exactly once.
"""

from __future__ import annotations

import pytest

from tests.reliability.conftest import ACME_KEY, client, start_server, unique
from tests.store.reply_proxy import ThreadedProxy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def proxy(redis_server):
    with ThreadedProxy(redis_server.url) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def proxied_server(proxy):
    with start_server(proxy.url) as live:
        yield live


@pytest.fixture
def acme(proxied_server):
    with client(proxied_server, ACME_KEY) as http:
        yield http


def test_a_created_session_whose_reply_was_lost_exists_once(acme, proxy):
    tag = unique("lost-create")
    proxy.arm(tag.encode())
    response = acme.post("/sessions", json={"system_prompt": "Be brief.", "metadata": {"t": tag}})
    assert response.status_code == 201, response.text
    assert proxy.dropped == 1
    sid = response.json()["id"]
    listed = acme.get("/sessions", params={"limit": 500}).json()["sessions"]
    assert [s["id"] for s in listed if s["metadata"].get("t") == tag] == [sid]
    history = acme.get(f"/sessions/{sid}/messages").json()["messages"]
    assert [m["role"] for m in history] == ["system"]


def test_a_turn_whose_commit_reply_was_lost_is_stored_once(acme, proxy):
    sid = acme.post("/sessions", json={}).json()["id"]
    first = unique("Say hello.")
    assert acme.post(f"/sessions/{sid}/messages", json=_turn(first)).status_code == 200
    dropped = proxy.dropped
    second = unique("Say goodbye.")
    proxy.arm(second.encode())  # the user's text travels only in the commit
    response = acme.post(f"/sessions/{sid}/messages", json=_turn(second))
    assert response.status_code == 200, response.text
    assert proxy.dropped == dropped + 1
    history = acme.get(f"/sessions/{sid}/messages").json()["messages"]
    assert [m["content"] for m in history if m["role"] == "user"] == [first, second]
    assert [m["role"] for m in history] == ["user", "assistant"] * 2
    assert acme.get(f"/sessions/{sid}").json()["num_messages"] == 4


def _turn(text: str) -> dict:
    return {"content": text, "max_tokens": 4, "temperature": 0}
