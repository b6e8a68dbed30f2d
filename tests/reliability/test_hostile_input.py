"""Hostile and malformed input by hand: each gets a clear 4xx JSON error and leaves
Redis byte-for-byte as it was; the per-tenant limits answer 429."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import urllib.error
import urllib.request

import pytest

from chatsvc.config import Limits
from tests.live_service import MAX_MODEL_LEN
from tests.reliability.conftest import (
    ACME_KEY,
    GLOBEX_KEY,
    RELIABILITY_LIMITS,
    client,
    keyspace,
    new_session,
    start_server,
    unique,
)

LIMITS = RELIABILITY_LIMITS


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


@pytest.fixture
def session_id(acme):
    return new_session(acme)["id"]


def test_huge_body_is_413(server, raw_redis, acme, session_id):
    big = "x" * (LIMITS.max_body_bytes + 1)
    _rejected(
        server,
        raw_redis,
        lambda: acme.post(f"/sessions/{session_id}/messages", json={"content": big}),
        413,
        "request_too_large",
    )


def test_a_body_sent_whole_before_the_answer_is_read_gets_its_413(server, raw_redis):
    # urllib writes the whole body before it reads: a server that answers and
    # closes with most of it unread resets the connection, and the client saw a
    # broken pipe, not the 413. 32 MiB: more than the sockets' buffers hold.
    big = b'{"metadata": {"k": "' + b"x" * (32 * 1024 * 1024) + b'"}}'
    request = urllib.request.Request(
        server.url + "/sessions",
        data=big,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {ACME_KEY}"},
    )
    before = keyspace(raw_redis, server.prefix)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 413
    assert json.loads(info.value.read())["error"]["type"] == "request_too_large"
    assert keyspace(raw_redis, server.prefix) == before


def test_a_chunked_body_over_the_limit_gets_its_413(server, raw_redis, acme):
    # No Content-Length to refuse it by: the limit is passed while the body arrives,
    # with the rest of it still coming (a reset, had the server closed then).
    def chunks():
        yield b'{"metadata": {"k": "'
        for _ in range(192):  # 12 MiB: past what the sockets' buffers hold
            yield b"x" * 65_536
        yield b'"}}'

    before = keyspace(raw_redis, server.prefix)
    response = acme.post(
        "/sessions", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413, response.text
    assert response.json()["error"]["type"] == "request_too_large"
    assert str(LIMITS.max_body_bytes) in response.json()["error"]["message"]
    assert keyspace(raw_redis, server.prefix) == before


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (b"[" * 5000 + b"]" * 5000, {}),  # deeply nested JSON
        (b'{"content": "\xff\xfe bad utf-8"}', {}),
        (b'{"content": "hi", "bogus_field": 1}', {}),  # unknown field
        (b'{"content": "hi"', {}),  # truncated JSON
        (b"", {}),
    ],
    ids=["nested", "bad-utf8", "unknown-field", "truncated", "empty"],
)
def test_malformed_bodies_are_400(server, raw_redis, acme, session_id, body, headers):
    send_headers = {"Content-Type": "application/json", **headers}
    _rejected(
        server,
        raw_redis,
        lambda: acme.post(f"/sessions/{session_id}/messages", content=body, headers=send_headers),
        400,
    )


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/xml", "multipart/form-data", "application/x-www-form-urlencoded"],
)
def test_wrong_content_type_is_415(server, raw_redis, acme, session_id, content_type):
    _rejected(
        server,
        raw_redis,
        lambda: acme.post(
            f"/sessions/{session_id}/messages",
            content=b'{"content": "hi"}',
            headers={"Content-Type": content_type},
        ),
        415,
        "unsupported_media_type",
    )


@pytest.mark.parametrize(
    "options",
    [
        {"content": "\x00\x01\x02 \x1b\x7f"},  # control characters only: nothing visible
        {"content": "   "},
        {"content": "y" * (LIMITS.max_message_chars + 1)},
        {"content": "hi", "max_tokens": 0},
        {"content": "hi", "max_tokens": -5},
        {"content": "hi", "max_tokens": 10**12},
        {"content": "hi", "max_tokens": 10**30},
        {"content": "hi", "temperature": -1},
        {"content": "hi", "top_p": 1.5},
        {"content": "hi", "stop": "not-a-list"},
    ],
)
def test_bad_message_values_are_400(server, raw_redis, acme, session_id, options):
    _rejected(
        server, raw_redis, lambda: acme.post(f"/sessions/{session_id}/messages", json=options), 400
    )


TOO_MUCH_METADATA = {f"k{i}": "v" for i in range(65)}


def _conversation(acme) -> str:
    response = acme.post("/v1/conversations", json={})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _model(acme) -> str:
    return acme.get("/v1/models").json()["data"][0]["id"]


# Each endpoint that takes a value the store or the engine refuses: the refusal is
# a 4xx with the field named, never a 500 (nor a 404 for a session that exists).
# HUGE is sent as the JSON number 1e400, which decodes as inf; 1e-40 is a
# subnormal whose reciprocal overflows fp32.
HUGE = "<1e400>"
HOSTILE_VALUES = {
    "session-metadata": lambda acme: ("/sessions", {"metadata": TOO_MUCH_METADATA}),
    "conversation-metadata": lambda acme: ("/v1/conversations", {"metadata": TOO_MUCH_METADATA}),
    "conversation-update-metadata": lambda acme: (
        f"/v1/conversations/{_conversation(acme)}",
        {"metadata": TOO_MUCH_METADATA},
    ),
    "response-metadata": lambda acme: (
        "/v1/responses",
        {
            "model": _model(acme),
            "input": "hi",
            "max_output_tokens": 2,
            "metadata": TOO_MUCH_METADATA,
        },
    ),
    "message-huge-temperature": lambda acme: (
        f"/sessions/{new_session(acme)['id']}/messages",
        {"content": "hi", "max_tokens": 2, "temperature": HUGE},
    ),
    "chat-tiny-repetition-penalty": lambda acme: (
        "/v1/chat/completions",
        {
            "model": _model(acme),
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "temperature": 1.0,
            "repetition_penalty": 1e-40,
        },
    ),
    "chat-huge-top-p": lambda acme: (
        "/v1/chat/completions",
        {
            "model": _model(acme),
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "top_p": HUGE,
        },
    ),
    "completion-tiny-repetition-penalty": lambda acme: (
        "/v1/completions",
        {"model": _model(acme), "prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e-40},
    ),
    "completion-huge-max-tokens": lambda acme: (
        "/v1/completions",
        {"model": _model(acme), "prompt": "hi", "max_tokens": 10**400},
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_VALUES))
def test_hostile_values_are_400_at_every_endpoint(server, raw_redis, acme, case):
    path, body = HOSTILE_VALUES[case](acme)
    content = json.dumps(body).replace(f'"{HUGE}"', "1e400")
    headers = {"Content-Type": "application/json"}
    _rejected(server, raw_redis, lambda: acme.post(path, content=content, headers=headers), 400)


def test_nul_and_control_text_is_served_or_refused_cleanly(server, raw_redis, acme, session_id):
    # Control characters inside real text are text: the turn runs and is stored whole.
    response = acme.post(
        f"/sessions/{session_id}/messages",
        json={"content": unique("a\x00b\x07c"), "max_tokens": 2, "temperature": 0},
    )
    assert response.status_code == 200, response.text


def test_prompt_past_the_context_is_400(server, raw_redis, acme, session_id):
    # ~1 token per word: well past the 1,024-token context, under the char limit.
    long_text = " ".join(f"w{i}" for i in range(MAX_MODEL_LEN))[: LIMITS.max_message_chars]
    _rejected(
        server,
        raw_redis,
        lambda: acme.post(f"/sessions/{session_id}/messages", json={"content": long_text}),
        400,
        "context_length_exceeded",
    )


def test_openai_n_too_large_and_bad_roles_are_400(server, raw_redis, acme):
    model = acme.get("/v1/models").json()["data"][0]["id"]
    base = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for body in (
        {**base, "n": LIMITS.max_n + 1},
        {**base, "n": 0},
        {**base, "messages": [{"role": "wizard", "content": "hi"}]},
        {**base, "messages": []},
        {**base, "max_tokens": -1},
    ):
        _rejected(server, raw_redis, lambda b=body: acme.post("/v1/chat/completions", json=b), 400)


def _read_all(sock: socket.socket, into: list[bytes]) -> None:
    while chunk := sock.recv(4096):
        into.append(chunk)


MESSAGE_CAP = 40


@pytest.fixture(scope="module")
def strict_server(redis_server):
    """A server with a short body deadline, two streams per tenant, long answers and
    a small cap on a session's messages."""
    limits = Limits(
        body_read_timeout_s=2,
        max_streams_per_tenant=2,
        max_tokens_cap=512,
        max_messages_per_session=MESSAGE_CAP,
    )
    with start_server(redis_server.url, limits) as live:
        yield live


def test_slow_loris_body_times_out_and_others_are_served(strict_server):
    with socket.create_connection(("127.0.0.1", strict_server.port), timeout=60) as sock:
        sock.sendall(
            b"POST /sessions HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {ACME_KEY}\r\n".encode()
            + b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"meta'
        )
        answer: list[bytes] = []
        reader = threading.Thread(target=_read_all, args=(sock, answer))
        reader.start()
        # While the stalled request waits, another client is served.
        with client(strict_server, ACME_KEY) as http:
            assert http.get("/sessions").status_code == 200
        reader.join(timeout=60)
    raw = b"".join(answer)
    assert raw.startswith(b"HTTP/1.1 408"), raw
    assert b"request_timeout" in raw


def test_concurrent_streams_per_tenant_limit_is_429(strict_server, raw_redis):
    # Each stream keeps its one line iterator for its whole life. Dropping the
    # iterator of ``next(response.iter_lines())`` closes it, and closing httpx's
    # byte stream mid-body closes the connection: the server sees a disconnect,
    # aborts that generation and frees its slot (as it must), so the third
    # request used to find the tenant's counter at zero.
    # The two generations hold their slots through the refusal: 200 tokens whatever
    # the model would answer (a native turn may end after a few tokens, and its commit
    # then lands in the keyspace the refusal is checked against). They are OpenAI
    # streams, which store nothing: the limit is the tenant's, whatever the endpoint.
    tenant = strict_server.services.tenants.tenant_for_key(GLOBEX_KEY)
    lines = []
    with client(strict_server, GLOBEX_KEY) as http, contextlib.ExitStack() as streams:
        for _ in range(2):
            body = {
                "model": _model(http),
                "messages": [{"role": "user", "content": unique("Count to 400.")}],
                "stream": True,
                "max_tokens": 200,
                "ignore_eos": True,
                "temperature": 0,
            }
            response = streams.enter_context(http.stream("POST", "/v1/chat/completions", json=body))
            assert response.status_code == 200
            lines.append(response.iter_lines())
            next(lines[-1])  # the generation is running
        assert strict_server.services.streams.active(tenant.id) == 2
        sid = new_session(http)["id"]
        body = _rejected(
            strict_server,
            raw_redis,
            lambda: http.post(f"/sessions/{sid}/messages", json={"content": "hi"}),
            429,
            "rate_limit_error",
        )
        assert "generations" in body["error"]["message"]
        assert strict_server.services.streams.active(tenant.id) == 2
        # Both generations ran on to their end.
        for stream_lines in lines:
            tail = list(stream_lines)
            assert "data: [DONE]" in tail, tail[-3:]
    assert strict_server.services.streams.active(tenant.id) == 0


def test_sessions_per_tenant_limit_is_429(server, raw_redis, carol):
    created = 0
    while True:
        response = carol.post("/sessions", json={})
        if response.status_code != 201:
            break
        created += 1
        assert created <= LIMITS.max_sessions_per_tenant
    assert created == LIMITS.max_sessions_per_tenant
    body = _rejected(server, raw_redis, lambda: carol.post("/sessions", json={}), 429)
    assert "sessions" in body["error"]["message"]
    # Deleting one makes room again.
    first = carol.get("/sessions", params={"limit": 1}).json()["sessions"][0]["id"]
    assert carol.delete(f"/sessions/{first}").status_code == 204
    assert carol.post("/sessions", json={}).status_code == 201


def test_adding_items_at_the_message_cap_is_429(strict_server, raw_redis):
    items = [{"role": "user", "content": f"item {i}"} for i in range(MESSAGE_CAP // 2)]
    with client(strict_server, ACME_KEY) as http:
        created = http.post("/v1/conversations", json={"items": items})
        assert created.status_code == 200, created.text
        path = f"/v1/conversations/{created.json()['id']}/items"
        assert http.post(path, json={"items": items}).status_code == 200
        one = {"items": items[:1]}
        body = _rejected(strict_server, raw_redis, lambda: http.post(path, json=one), 429)
    assert "limit" in body["error"]["message"]
