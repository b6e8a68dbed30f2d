"""Hostile input to the Responses and Conversations APIs and to branching: each gets a clear
4xx JSON error and leaves Redis byte-for-byte as it was (another tenant's ids included)."""

from __future__ import annotations

import pytest

from tests.reliability.conftest import (
    RELIABILITY_LIMITS,
    keyspace,
    new_session,
    say,
    unique,
)

LIMITS = RELIABILITY_LIMITS
ITEM = {"role": "user", "content": "x"}


def _rejected(server, raw_redis, send, status: int, error_type: str | None = None) -> dict:
    before = keyspace(raw_redis, server.prefix)
    response = send()
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and body["error"]["message"], body
    if error_type is not None:
        assert body["error"]["type"] == error_type, body
    assert keyspace(raw_redis, server.prefix) == before
    return body


@pytest.fixture(scope="module")
def model(server) -> str:
    from tests.reliability.conftest import ACME_KEY, client

    with client(server, ACME_KEY) as http:
        return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture
def chain(acme, model) -> dict:
    """A stored response of acme's, in a session of its own."""
    body = {"model": model, "input": unique("Hello."), "max_output_tokens": 2}
    response = acme.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    return response.json()


BAD_INPUTS = {
    "unknown-role": [{"role": "robot", "content": "x"}],
    "tool-output-item": [{"type": "function_call_output", "call_id": "c", "output": "x"}],
    "image-part": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
    "no-content": [{"role": "user"}],
    "empty-list": [],
    "ends-with-assistant": [ITEM, {"role": "assistant", "content": "b"}],
    "blank-text": [{"role": "user", "content": "   "}],
    "not-a-list": 42,
    "nested-garbage": [[[[{"role": "user"}]]]],
    "too-long": "w " * (LIMITS.max_message_chars // 2 + 1),
    "too-long-in-all": [{"role": "user", "content": "w " * 1900}] * 5,
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_malformed_input_is_400(server, raw_redis, acme, model, chain, name):
    for where in ({}, {"previous_response_id": chain["id"]}):
        body = {"model": model, "input": BAD_INPUTS[name], "max_output_tokens": 2, **where}
        _rejected(server, raw_redis, lambda b=body: acme.post("/v1/responses", json=b), 400)


@pytest.mark.parametrize(
    "extra",
    [
        {"max_output_tokens": LIMITS.max_tokens_cap + 1},
        {"temperature": -1},
        {"top_p": 2},
        {"metadata": {f"k{i}": "v" for i in range(65)}},
        {"metadata": {"k": 1}},
        {"prompt_cache_key": "line\nbreak"},
        {"safety_identifier": "x" * 300},
        {"instructions": " "},
        {"store": False, "conversation": "0" * 32},
        {"stream": True, "tools": [{"type": "web_search"}]},
    ],
    ids=lambda extra: ",".join(extra),
)
def test_bad_options_are_400(server, raw_redis, acme, model, chain, extra):
    body = {"model": model, "input": "hi", "previous_response_id": chain["id"], **extra}
    body.setdefault("max_output_tokens", 2)
    if "conversation" in extra:
        del body["previous_response_id"]
    _rejected(server, raw_redis, lambda: acme.post("/v1/responses", json=body), 400)


def test_a_prompt_past_the_context_is_400_and_stores_nothing(server, raw_redis, acme, model, chain):
    words = [{"role": "user", "content": "lorem ipsum dolor sit amet " * 110}] * 5
    for where in ({}, {"previous_response_id": chain["id"]}):
        body = {"model": model, "input": words, "max_output_tokens": 2, **where}
        _rejected(
            server,
            raw_redis,
            lambda b=body: acme.post("/v1/responses", json=b),
            400,
            "context_length_exceeded",
        )


def test_huge_bodies_are_413(server, raw_redis, acme, model):
    items = [{"role": "user", "content": "x"}] * 2000
    for path, body in (
        ("/v1/responses", {"model": model, "input": items}),
        ("/v1/conversations", {"items": items}),
    ):
        _rejected(server, raw_redis, lambda p=path, b=body: acme.post(p, json=b), 413)


def test_unknown_and_foreign_ids_answer_404_alike(server, raw_redis, acme, globex, model, chain):
    sid = chain["id"].split("_")[1]
    unknown = f"resp_{'0' * 32}_{'0' * 16}"
    cid = acme.post("/v1/conversations", json={"items": [ITEM]}).json()["id"]
    item = acme.get(f"/v1/conversations/{cid}/items").json()["data"][0]["id"]
    bodies = {}
    for who, rid, conv in (("foreign", chain["id"], cid), ("unknown", unknown, "0" * 32)):
        sends = [
            lambda r=rid: globex.get(f"/v1/responses/{r}"),
            lambda r=rid: globex.delete(f"/v1/responses/{r}"),
            lambda r=rid: globex.get(f"/v1/responses/{r}/input_items"),
            lambda r=rid: globex.post(
                "/v1/responses", json={"model": model, "input": "x", "previous_response_id": r}
            ),
            lambda c=conv: globex.get(f"/v1/conversations/{c}"),
            lambda c=conv: globex.post(f"/v1/conversations/{c}", json={"metadata": {}}),
            lambda c=conv: globex.delete(f"/v1/conversations/{c}"),
            lambda c=conv: globex.get(f"/v1/conversations/{c}/items"),
            lambda c=conv: globex.post(f"/v1/conversations/{c}/items", json={"items": [ITEM]}),
            lambda c=conv: globex.get(f"/v1/conversations/{c}/items/{item}"),
            lambda c=conv: globex.delete(f"/v1/conversations/{c}/items/{item}"),
            lambda c=conv: globex.post(
                "/v1/responses", json={"model": model, "input": "x", "conversation": c}
            ),
        ]
        bodies[who] = [_rejected(server, raw_redis, send, 404) for send in sends]
    assert bodies["foreign"] == bodies["unknown"]
    malformed = ["resp_x", "resp_../../etc_0123456789abcdef", "a" * 200, "%00"]
    for bad in malformed:
        _rejected(server, raw_redis, lambda b=bad: acme.get(f"/v1/responses/{b}"), 404)
        _rejected(server, raw_redis, lambda b=bad: acme.get(f"/v1/conversations/{b}"), 404)
        _rejected(
            server, raw_redis, lambda b=bad: acme.get(f"/v1/conversations/{cid}/items/{b}"), 404
        )
    assert acme.get(f"/sessions/{sid}").status_code == 200


def test_bad_conversation_requests_are_4xx(server, raw_redis, acme):
    cid = acme.post("/v1/conversations", json={}).json()["id"]
    cases = [
        ("post", "/v1/conversations", {"items": [ITEM] * 21}, 400),
        ("post", "/v1/conversations", {"items": [{"role": "robot", "content": "x"}]}, 400),
        ("post", "/v1/conversations", {"metadata": {"k": 7}}, 400),
        ("post", "/v1/conversations", {"bogus": 1}, 400),
        ("post", f"/v1/conversations/{cid}/items", {"items": []}, 400),
        ("post", f"/v1/conversations/{cid}/items", {"items": [{"type": "reasoning"}]}, 400),
        ("post", f"/v1/conversations/{cid}", {"metadata": {"k": ["v"]}}, 400),
        ("post", f"/v1/conversations/{cid}", {}, 400),
        ("get", f"/v1/conversations/{cid}/items?limit=0", None, 400),
        ("get", f"/v1/conversations/{cid}/items?order=sideways", None, 400),
        ("get", f"/v1/conversations/{cid}/items?after=msg_0000000000000000", None, 400),
        ("delete", f"/v1/conversations/{cid}/items/msg_0000000000000000", None, 404),
    ]
    for verb, path, body, status in cases:

        def send(verb=verb, path=path, body=body):
            return acme.request(verb.upper(), path, json=body)

        _rejected(server, raw_redis, send, status)


def test_bad_branch_requests_are_4xx(server, raw_redis, acme):
    sid = new_session(acme)["id"]
    say(acme, sid, unique("Hello."))
    cases = [
        ("put", f"/sessions/{sid}/branch", {"message_id": 7}, 400),
        ("put", f"/sessions/{sid}/branch", {"message_id": "msg_0000000000000000"}, 404),
        ("put", f"/sessions/{sid}/branch", {"message_id": "../x"}, 404),
        ("delete", f"/sessions/{sid}/messages/msg_0000000000000000", None, 404),
        ("get", f"/sessions/{sid}/messages?leaf_id=msg_0000000000000000", None, 404),
        ("post", f"/sessions/{sid}/messages", {"regenerate": "yes"}, 400),
        ("post", f"/sessions/{sid}/messages", {"content": "x", "parent_message_id": "root!"}, 404),
    ]
    for verb, path, body, status in cases:

        def send(verb=verb, path=path, body=body):
            return acme.request(verb.upper(), path, json=body)

        _rejected(server, raw_redis, send, status)
