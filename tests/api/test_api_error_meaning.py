"""A 400 means the client's input was bad; a failure of ours is a 500 that tells nothing.

Every ``ValueError`` out of the store used to count as a malformed id, so a record
that no longer decodes read as "no such session".
"""

from __future__ import annotations

from tests.api.conftest import keyspace, new_session, unique


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
