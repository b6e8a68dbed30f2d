"""Tenant isolation: one tenant's ids confirm nothing to another,
keys are stored hashed and compared in constant time, and the admin API has its own key.
"""

from __future__ import annotations

import hmac
import uuid

import pytest

from tests.reliability.conftest import (
    ADMIN_KEY,
    GLOBEX_KEY,
    TENANT_KEYS,
    client,
    keyspace,
    new_session,
    say,
    unique,
)


def _prompt(http, *, shared: bool) -> dict:
    """A private prompt of the caller, or (``http`` holding the admin key) a shared one."""
    body = {"name": unique("prompt"), "text": unique("You are terse.")}
    response = http.post("/admin/system-prompts" if shared else "/system-prompts", json=body)
    assert response.status_code == 201, response.text
    return response.json()


@pytest.fixture
def acme_private(acme):
    """acme's private prompt and a session on it with one stored turn."""
    prompt = _prompt(acme, shared=False)
    session = new_session(acme, system_prompt_id=prompt["id"])
    say(acme, session["id"], unique("Remember the word heliotrope."))
    return {"prompt": prompt, "session": session}


def _same_as_unknown(http, method: str, path: str, foreign_id: str, **kwargs) -> None:
    """``path`` with another tenant's id answers exactly as with an id nobody has."""
    unknown_id = uuid.uuid4().hex
    foreign = http.request(method, path.format(id=foreign_id), **kwargs)
    unknown = http.request(method, path.format(id=unknown_id), **kwargs)
    assert foreign.status_code == 404, (method, path, foreign.status_code, foreign.text)
    assert unknown.status_code == 404, (method, path, unknown.status_code, unknown.text)
    assert foreign.content == unknown.content, (method, path)
    assert foreign.headers["content-type"] == unknown.headers["content-type"]
    assert foreign.json()["error"]["type"] == "not_found_error"


def test_foreign_ids_answer_like_unknown_ones(server, raw_redis, acme, globex, acme_private):
    sid = acme_private["session"]["id"]
    pid = acme_private["prompt"]["id"]
    before = keyspace(raw_redis, server.prefix)
    history = acme.get(f"/sessions/{sid}/messages").json()

    _same_as_unknown(globex, "GET", "/sessions/{id}", sid)
    _same_as_unknown(globex, "GET", "/sessions/{id}/messages", sid)
    _same_as_unknown(
        globex,
        "POST",
        "/sessions/{id}/messages",
        sid,
        json={"content": "Which word did I ask you to remember?", "max_tokens": 4},
    )
    _same_as_unknown(
        globex,
        "POST",
        "/sessions/{id}/messages",
        sid,
        json={"content": "and streamed?", "max_tokens": 4, "stream": True},
    )
    _same_as_unknown(globex, "DELETE", "/sessions/{id}", sid)
    _same_as_unknown(globex, "GET", "/system-prompts/{id}", pid)
    # Nor does a session get created on the foreign prompt.
    foreign = globex.post("/sessions", json={"system_prompt_id": pid})
    unknown = globex.post("/sessions", json={"system_prompt_id": uuid.uuid4().hex})
    assert foreign.status_code == unknown.status_code == 404, foreign.text
    assert foreign.content == unknown.content

    # Nothing globex did touched a byte of Redis, and acme's session is intact.
    assert keyspace(raw_redis, server.prefix) == before
    assert acme.get(f"/sessions/{sid}/messages").json() == history


def test_listings_show_own_and_shared_only(acme, globex, admin, acme_private):
    shared = _prompt(admin, shared=True)
    globex_session = new_session(globex)

    acme_sessions = {
        s["id"] for s in acme.get("/sessions", params={"limit": 500}).json()["sessions"]
    }
    globex_sessions = {
        s["id"] for s in globex.get("/sessions", params={"limit": 500}).json()["sessions"]
    }
    assert acme_private["session"]["id"] in acme_sessions
    assert globex_session["id"] in globex_sessions
    assert not acme_sessions & globex_sessions

    globex_prompts = {p["id"]: p for p in globex.get("/system-prompts").json()["system_prompts"]}
    acme_prompts = {p["id"] for p in acme.get("/system-prompts").json()["system_prompts"]}
    assert acme_private["prompt"]["id"] in acme_prompts
    assert acme_private["prompt"]["id"] not in globex_prompts
    assert all(p["shared"] for p in globex_prompts.values() if p["id"] in acme_prompts), (
        "globex sees only acme's shared prompts"
    )

    # The shared prompt is visible to both and usable by the other tenant.
    assert shared["id"] in globex_prompts and shared["id"] in acme_prompts
    assert globex.get(f"/system-prompts/{shared['id']}").json()["text"] == shared["text"]
    session = new_session(globex, system_prompt_id=shared["id"])
    assert say(globex, session["id"], unique("Hello."))["message"]["role"] == "assistant"


def _every_value(raw_redis, key: bytes) -> list[bytes]:
    """Every stored byte string of ``key``, whatever its type (DUMP may compress)."""
    kind = raw_redis.type(key)
    if kind == b"string":
        return [raw_redis.get(key)]
    if kind == b"hash":
        return [part for pair in raw_redis.hgetall(key).items() for part in pair]
    if kind == b"set":
        return list(raw_redis.smembers(key))
    if kind == b"zset":
        return [member for member, _ in raw_redis.zrange(key, 0, -1, withscores=True)]
    if kind == b"list":
        return raw_redis.lrange(key, 0, -1)
    raise AssertionError(f"{key!r} has a type this check does not read: {kind!r}")


def test_no_raw_key_is_stored(server, raw_redis, acme_private):
    secrets = [k.encode() for k in (*TENANT_KEYS.values(), ADMIN_KEY)]
    keys = list(raw_redis.scan_iter(match=f"{server.prefix}:*"))
    assert len(keys) > 10  # the tenants, their key hashes, prompts and sessions are all there
    for key in keys:
        for blob in [key, *_every_value(raw_redis, key)]:
            for secret in secrets:
                assert secret not in blob, f"{secret!r} stored in {key!r}"


def test_key_lookup_compares_in_constant_time(server, monkeypatch):
    from chatsvc.store import hash_api_key

    calls: list[tuple] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    tenants = server.services.tenants
    tenant = tenants.tenant_for_key(GLOBEX_KEY)
    assert tenant is not None and tenant.name == "globex"
    # Every configured key's digest is compared with the caller's, each in constant time.
    assert sorted(a for a, _ in calls) == sorted(hash_api_key(k) for k in TENANT_KEYS.values())
    assert {b for _, b in calls} == {hash_api_key(GLOBEX_KEY)}
    assert tenants.tenant_for_key(GLOBEX_KEY + "x") is None

    # The admin key goes through compare_digest as well, on the request path.
    calls.clear()
    with client(server, ADMIN_KEY + "-wrong") as http:
        assert http.get("/admin/cache").status_code == 403
    assert ((ADMIN_KEY + "-wrong").encode(), ADMIN_KEY.encode()) in calls


@pytest.mark.parametrize("path", ["/admin/cache", "/metrics"])
def test_admin_api_needs_the_admin_key(server, path):
    for key in TENANT_KEYS.values():
        with client(server, key) as http:
            response = http.get(path)
        assert response.status_code == 403, response.text
        assert response.json()["error"]["type"] == "permission_error"
    with client(server, None) as http:
        response = http.get(path)
    assert response.status_code == 401, response.text
    assert response.json()["error"]["type"] == "authentication_error"
    with client(server, ADMIN_KEY) as http:
        assert http.get(path).status_code == 200
        # The admin key is no tenant's key: it opens no tenant route.
        response = http.get("/sessions")
    assert response.status_code == 401, response.text
    assert response.json()["error"]["type"] == "authentication_error"
