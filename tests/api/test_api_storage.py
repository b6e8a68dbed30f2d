"""Storage bounded in bytes, lists paged at the store: over HTTP, on the shared server.

The quotas of the shared server are the defaults (64 MiB a session, 8 GiB a
tenant), far past what a cheap test writes; the tests that need one reached
move its counter there in Redis (what the store tests show the writes keep
exact), and move it back after.
"""

from __future__ import annotations

import contextlib

from chatsvc.store.commit import TOTAL
from chatsvc.store.keys import Keys
from tests.http_helpers import keyspace, new_session, unique


def _items(n: int, text: str = "item") -> list[dict]:
    return [{"type": "message", "role": "user", "content": f"{text} {i}"} for i in range(n)]


@contextlib.contextmanager
def _counted_up(api, raw_redis, tenant: str, field: str, to: int):
    """The tenant's counter ``field`` (a session id, or the total) raised to ``to``."""
    keys = Keys(api.services.settings.key_prefix)
    tenant_id = raw_redis.hget(keys.tenant_names(), tenant).decode()
    counters = keys.tenant_bytes(tenant_id)
    added = to - int(raw_redis.hget(counters, field) or 0)
    raw_redis.hincrby(counters, field, added)
    try:
        yield
    finally:
        raw_redis.hincrby(counters, field, -added)


def test_a_session_at_its_quota_answers_429_naming_the_limit(api, acme, raw_redis):
    limit = api.services.settings.limits.max_session_bytes
    cid = acme.post("/v1/conversations", json={"items": _items(1)}).json()["id"]
    prefix = api.services.settings.key_prefix
    with _counted_up(api, raw_redis, "acme", cid, limit):
        before = keyspace(raw_redis, prefix)
        refused = acme.post(f"/v1/conversations/{cid}/items", json={"items": _items(2)})
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error"
        assert error["message"] == f"session storage limit (max_session_bytes={limit}) reached"
        # A turn is refused before the model runs, with the same message.
        turn = acme.post(
            f"/sessions/{cid}/messages", json={"content": unique("hi"), "max_tokens": 1}
        )
        assert turn.status_code == 429 and turn.json()["error"] == error
        assert keyspace(raw_redis, prefix) == before
        # Deleting frees bytes: always allowed, also at the quota.
        item = acme.get(f"/v1/conversations/{cid}/items").json()["data"][0]["id"]
        assert acme.delete(f"/v1/conversations/{cid}/items/{item}").status_code == 200
    added = acme.post(f"/v1/conversations/{cid}/items", json={"items": _items(2)})
    assert added.status_code == 200, added.text


def test_a_tenant_at_its_quota_does_not_stop_another_tenant(api, acme, globex, raw_redis):
    limit = api.services.settings.limits.max_tenant_bytes
    with _counted_up(api, raw_redis, "globex", TOTAL, limit):
        refused = globex.post("/v1/conversations", json={"items": _items(1)})
        assert refused.status_code == 429, refused.text
        message = refused.json()["error"]["message"]
        assert message == f"tenant storage limit (max_tenant_bytes={limit}) reached"
        assert acme.post("/v1/conversations", json={"items": _items(1)}).status_code == 200
        assert new_session(acme)["id"]
        report = api_admin_storage(api)
        assert report["bytes_used_by_tenant"]["globex"] == limit
        assert report["max_tenant_bytes"] == limit


def api_admin_storage(api) -> dict:
    from tests.api.conftest import ADMIN_KEY, client

    with client(api, ADMIN_KEY) as admin:
        response = admin.get("/admin/cache")
        assert response.status_code == 200, response.text
        return response.json()["storage"]


def test_admin_reports_each_tenants_stored_bytes(api, acme):
    before = api_admin_storage(api)
    assert before["max_session_bytes"] == api.services.settings.limits.max_session_bytes
    acme.post("/v1/conversations", json={"items": _items(3, "x" * 1000)})
    after = api_admin_storage(api)
    assert after["bytes_used_by_tenant"]["acme"] >= before["bytes_used_by_tenant"]["acme"] + 3000


def test_items_and_messages_come_in_pages(api, acme):
    cid = acme.post("/v1/conversations", json={"items": _items(20)}).json()["id"]
    acme.post(f"/v1/conversations/{cid}/items", json={"items": _items(5, "more")})
    texts = [f"item {i}" for i in range(20)] + [f"more {i}" for i in range(5)]

    page = acme.get(f"/v1/conversations/{cid}/items", params={"limit": 3}).json()
    assert [i["content"][0]["text"] for i in page["data"]] == texts[::-1][:3]
    assert page["has_more"] and page["last_id"] == page["data"][-1]["id"]
    rest = acme.get(
        f"/v1/conversations/{cid}/items", params={"limit": 100, "after": page["last_id"]}
    ).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == texts[::-1][3:]
    assert not rest["has_more"]

    native = f"/sessions/{cid}/messages"
    whole = acme.get(native).json()
    assert [m["content"] for m in whole["messages"]] == texts and not whole["has_more"]
    first = acme.get(native, params={"limit": 10}).json()
    assert first["messages"] == whole["messages"][:10] and first["has_more"]
    second = acme.get(native, params={"limit": 10, "after": first["messages"][-1]["id"]}).json()
    assert second["messages"] == whole["messages"][10:20] and second["has_more"]
    assert second["continuations"] == whole["continuations"]

    for url, params in (
        (native, {"limit": 1001}),
        (native, {"limit": 0}),
        (native, {"after": "msg_unknown"}),
        (f"/v1/conversations/{cid}/items", {"limit": 101}),
        (f"/v1/conversations/{cid}/items", {"after": "msg_unknown"}),
    ):
        response = acme.get(url, params=params)
        assert response.status_code == 400, (url, params, response.text)
