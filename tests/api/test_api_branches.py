"""Regenerate, edit-and-branch, switch and delete branches in the native API (real model, Redis)."""

from __future__ import annotations

from tests.api.conftest import BLOCK_SIZE, keyspace, new_session, say, unique


def _messages(http, sid, **params) -> dict:
    response = http.get(f"/sessions/{sid}/messages", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def _post(http, sid, **body):
    return http.post(f"/sessions/{sid}/messages", json={"max_tokens": 6, "temperature": 0, **body})


def _cached_floor(prompt_tokens: int) -> int:
    # Everything but the last prompt token is reusable, in full blocks.
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_regenerate_keeps_the_old_answer_as_a_sibling_and_reuses_the_prompt(acme):
    sid = new_session(acme, system_prompt=unique("You are terse."))["id"]
    say(acme, sid, unique("Name a fruit."), max_tokens=6)
    first = say(acme, sid, "And a vegetable?", max_tokens=6)
    old = _messages(acme, sid)["messages"]

    again = _post(acme, sid, regenerate=True, temperature=1.0, seed=7)
    assert again.status_code == 200, again.text
    result = again.json()
    # The same prompt as the original turn, and all of it but the tail block cached.
    assert result["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert result["usage"]["cached_tokens"] >= _cached_floor(result["usage"]["prompt_tokens"])
    assert result["message"]["parent_id"] == old[-2]["id"]

    new = _messages(acme, sid)["messages"]
    assert [m["id"] for m in new[:-1]] == [m["id"] for m in old[:-1]]
    assert new[-1]["id"] == result["message"]["id"] != old[-1]["id"]
    assert new[-1]["sibling_ids"] == [old[-1]["id"], new[-1]["id"]]
    assert all(len(m["sibling_ids"]) == 1 for m in new[:-1])

    # The old version is one switch away, and the next turn continues what is active.
    switched = acme.put(f"/sessions/{sid}/branch", json={"message_id": old[-1]["id"]})
    assert switched.status_code == 200, switched.text
    assert [m["content"] for m in switched.json()["messages"]] == [m["content"] for m in old]
    after = say(acme, sid, "One more?", max_tokens=4)
    assert after["prefix_reused"] is True
    assert _messages(acme, sid)["messages"][-3]["id"] == old[-1]["id"]


def test_editing_a_user_message_branches_from_the_message_before_it(acme):
    sid = new_session(acme, system_prompt=unique("You are terse."))["id"]
    first = say(acme, sid, unique("Name a city."), max_tokens=6)
    say(acme, sid, "In Spain?", max_tokens=6)
    before = _messages(acme, sid)["messages"]
    tokens_before = acme.get(f"/sessions/{sid}").json()["num_tokens"]
    first_answer = before[2]

    edited = _post(acme, sid, content="In Italy?", parent_message_id=first_answer["id"])
    assert edited.status_code == 200, edited.text
    # Only the edited message and what follows are new: the shared head (the first
    # turn's prompt and answer) is cached.
    head = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert edited.json()["usage"]["cached_tokens"] >= (head - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    branch = _messages(acme, sid)["messages"]
    assert [m["content"] for m in branch][:3] == [m["content"] for m in before][:3]
    assert branch[3]["content"] == "In Italy?"
    assert branch[3]["sibling_ids"] == [before[3]["id"], branch[3]["id"]]

    # The other branch is still there, readable without switching to it.
    other = _messages(acme, sid, leaf_id=before[-1]["id"])["messages"]
    assert [m["content"] for m in other] == [m["content"] for m in before]

    # Deleting the edit removes only its two messages; the session falls back to the
    # branch that is left, whose tokens are exactly as they were.
    assert acme.delete(f"/sessions/{sid}/messages/{branch[3]['id']}").status_code == 204
    back = _messages(acme, sid)["messages"]
    assert [m["id"] for m in back] == [m["id"] for m in before]
    assert back[3]["sibling_ids"] == [before[3]["id"]]
    assert acme.get(f"/sessions/{sid}").json()["num_tokens"] == tokens_before
    assert say(acme, sid, "And in France?", max_tokens=4)["prefix_reused"] is True


def test_bad_branch_requests_are_refused_and_change_nothing(api, acme, globex, raw_redis):
    sid = new_session(acme)["id"]
    say(acme, sid, unique("Hello."), max_tokens=4)
    last = _messages(acme, sid)["messages"][-1]
    prefix = api.services.settings.key_prefix
    before = keyspace(raw_redis, prefix)
    cases = [
        (acme, "post", {"regenerate": True, "content": "x"}, 400),
        (acme, "post", {}, 400),
        (acme, "post", {"regenerate": True, "parent_message_id": last["id"]}, 400),
        (acme, "post", {"content": "x", "parent_message_id": "msg_0000000000000000"}, 404),
        (acme, "post", {"content": "x", "parent_message_id": "not an id!"}, 404),
        (acme, "put", {"message_id": "msg_0000000000000000"}, 404),
        (globex, "post", {"content": "x", "parent_message_id": last["id"]}, 404),
        (globex, "put", {"message_id": last["id"]}, 404),
        (globex, "delete", None, 404),
    ]
    for http, verb, body, status in cases:
        if verb == "post":
            response = _post(http, sid, **body)
        elif verb == "put":
            response = http.put(f"/sessions/{sid}/branch", json=body)
        else:
            response = http.delete(f"/sessions/{sid}/messages/{last['id']}")
        assert response.status_code == status, (verb, body, response.text)
        assert set(response.json()) == {"error"}
    assert keyspace(raw_redis, prefix) == before
    foreign = globex.get(f"/sessions/{sid}/messages", params={"leaf_id": last["id"]})
    assert foreign.status_code == 404


def test_branch_writes_wait_for_no_turn_they_get_409(acme):
    from chatsvc.chat_client import iter_sse

    sid = new_session(acme)["id"]
    say(acme, sid, unique("Hi."), max_tokens=4)
    first = _messages(acme, sid)["messages"][0]
    body = {"content": unique("Tell a long story."), "max_tokens": 48, "stream": True}
    with acme.stream("POST", f"/sessions/{sid}/messages", json=body) as running:
        lines = running.iter_lines()
        assert next(iter_sse(lines))[0] == "delta"  # the turn holds the session now
        # One running turn serves both writes: each would rewrite the tree under it.
        switch = acme.put(f"/sessions/{sid}/branch", json={"message_id": first["id"]})
        delete = acme.delete(f"/sessions/{sid}/messages/{first['id']}")
        for busy in (switch, delete):
            assert busy.status_code == 409 and busy.json()["error"]["type"] == "session_busy"
        assert [e for e, _ in iter_sse(lines)][-1] == "done"
    assert len(_messages(acme, sid)["messages"]) == 4
