"""A 400 means the client's input was bad; a failure of ours is a 500 that tells nothing.

Two places used to blur them: every ``ValueError`` out of the store counted as a
malformed id (so a record that no longer decodes read as "no such session"), and
every ``ValueError`` out of the chat format counted as a refused conversation
(so an internal failure was a 400 that quoted its detail to the client).
"""

from __future__ import annotations

from tests.api.conftest import keyspace, new_session, unique

GENERIC_500 = "internal server error"


def _server_error(response) -> dict:
    assert response.status_code == 500, response.text
    body = response.json()
    assert body["error"]["type"] == "server_error"
    return body


def test_a_record_that_does_not_decode_is_a_500_not_an_unknown_session(api, acme, raw_redis):
    prefix = api.services.settings.key_prefix
    session = new_session(acme, system_prompt=unique("Be brief."))
    sid = session["id"]
    summary_key = f"{prefix}:session:{{{sid}}}"
    assert raw_redis.get(summary_key) is not None
    # Not msgpack of a session summary: what a bug or a bad restore would leave.
    raw_redis.set(summary_key, b"\xc1 not a record")
    before = keyspace(raw_redis, prefix)

    for response in (
        acme.get(f"/sessions/{sid}"),
        acme.get(f"/sessions/{sid}/messages"),
        acme.post(f"/sessions/{sid}/messages", json={"content": unique("Hi."), "max_tokens": 2}),
    ):
        body = _server_error(response)
        assert "decode" not in body["error"]["message"].lower()
    # Nothing was written on the way, and a malformed id is still the client's 404.
    assert keyspace(raw_redis, prefix) == before
    assert acme.get("/sessions/not%20an%20id").status_code == 404
    raw_redis.delete(summary_key)


def test_a_chat_format_failure_that_is_not_bad_input_is_a_500(api, acme, monkeypatch):
    # A refusal is RequestValidationError (tests/engine/test_chat_format.py): still a 400.
    fmt = api.services.engine.chat_format
    real_render = fmt.render
    secret = "internal-detail-9f3a"

    def render(messages, add_generation_prompt=True):
        if any(secret in m["content"] for m in messages):
            raise ValueError(f"{secret}: the tokenizer's state is broken")
        return real_render(messages, add_generation_prompt)

    monkeypatch.setattr(fmt, "render", render)
    model = acme.get("/v1/models").json()["data"][0]["id"]
    request = {"model": model, "max_tokens": 2, "temperature": 0}
    failed = acme.post(
        "/v1/chat/completions", json={**request, "messages": [{"role": "user", "content": secret}]}
    )
    body = _server_error(failed)
    assert secret not in failed.text and body["error"]["message"] == GENERIC_500
    fine = acme.post(
        "/v1/chat/completions", json={**request, "messages": [{"role": "user", "content": "Hi"}]}
    )
    assert fine.status_code == 200, fine.text


def test_a_turn_no_replica_confirmed_is_not_called_unstored(api, acme, monkeypatch):
    # On Sentinel, WAIT can time out after the commit script ran: the turn is on the
    # primary. "Not stored, try again" made clients store it twice.
    from chatsvc.store.errors import UnconfirmedWriteError

    branches = api.services.store.branches
    real_commit = branches.commit_turn

    async def commit_then_unconfirmed(*args, **kwargs):
        await real_commit(*args, **kwargs)
        raise UnconfirmedWriteError("only 0 of 1 replica(s) confirmed a write within 500 ms")

    sid = new_session(acme)["id"]
    monkeypatch.setattr(branches, "commit_turn", commit_then_unconfirmed)
    body = {"content": unique("Hi."), "max_tokens": 2, "temperature": 0}
    answer = acme.post(f"/sessions/{sid}/messages", json=body)
    streamed = acme.post(f"/sessions/{sid}/messages", json={**body, "stream": True})
    monkeypatch.undo()
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["type"] == "store_write_unconfirmed" and "may be stored" in error["message"]
    assert "event: error" in streamed.text and "store_write_unconfirmed" in streamed.text
    assert "was not stored" not in answer.text + streamed.text
    # Both turns are there, as the answers allowed.
    messages = acme.get(f"/sessions/{sid}/messages").json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
