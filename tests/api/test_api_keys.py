"""Configured keys are the truth: the real service, restarted with changed
``CHATSVC_API_KEYS`` against the same Redis, and two replicas sharing one Redis.

Identity is the tenant's name: rotating its key keeps its sessions, removing it
from the settings makes its key answer 401 (its data stays), and each replica
admits exactly the keys of its own settings.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest

from bench.live_server import ThreadServer
from chatsvc.config import Settings
from tests import http_helpers
from tests.api.conftest import TEST_LIMITS, engine_config, new_session, say, unique
from tests.redis_server import unique_prefix

K1 = "acme-first-key-000000000001"
K2 = "acme-rotated-key-0000000002"
GLOBEX = "globex-key-00000000000000003"
INITECH_1 = "initech-replica-one-key-0004"
INITECH_2 = "initech-replica-two-key-0005"
ADMIN = "keys-admin-key-000000000006"
# Small caps, so the cap checks need only a few requests.
LIMITS = replace(TEST_LIMITS, max_system_prompts_per_tenant=2, max_shared_system_prompts=1)


def _engine():
    # Smaller than the API suite's pool: these servers run two at a time.
    return replace(engine_config(), num_gpu_blocks=128, num_host_blocks=0, max_num_seqs=4)


def _settings(redis_url: str, prefix: str, keys: dict[str, str]) -> Settings:
    return Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        admin_key=ADMIN,
        api_keys=tuple(keys.items()),
        limits=LIMITS,
        engine=_engine(),
    )


@contextlib.contextmanager
def serving(redis_url: str, prefix: str, keys: dict[str, str]) -> Iterator[ThreadServer]:
    from chatsvc.api.app import create_app

    with ThreadServer(create_app(_settings(redis_url, prefix, keys))) as server:
        yield server


def _http(server: ThreadServer, key: str) -> httpx.Client:
    return http_helpers.client(server.url, key, timeout_s=300)


def _status(server: ThreadServer, key: str) -> int:
    with _http(server, key) as http:
        return http.get("/sessions").status_code


def _session_ids(server: ThreadServer, key: str) -> set[str]:
    with _http(server, key) as http:
        response = http.get("/sessions", params={"limit": 500})
        assert response.status_code == 200, response.text
        return {s["id"] for s in response.json()["sessions"]}


@pytest.fixture(scope="module")
def prefix() -> str:
    return unique_prefix("keys")


def test_rotating_and_removing_keys_across_restarts(redis_server, prefix, raw_redis):
    with serving(redis_server.url, prefix, {"acme": K1, "globex": GLOBEX}) as first:
        with _http(first, K1) as acme:
            sid = new_session(acme, system_prompt=unique("You are brief."))["id"]
            say(acme, sid, unique("Remember the word heliotrope."))
            history = acme.get(f"/sessions/{sid}/messages").json()

    # Rotated: the old key is refused, the new one is the same tenant, sessions and all.
    with serving(redis_server.url, prefix, {"acme": K2, "globex": GLOBEX}) as rotated:
        assert _status(rotated, K1) == 401
        assert sid in _session_ids(rotated, K2)
        with _http(rotated, K2) as acme:
            assert acme.get(f"/sessions/{sid}/messages").json() == history
            assert say(acme, sid, unique("And now?"))["prefix_reused"] is True
            history = acme.get(f"/sessions/{sid}/messages").json()
        assert sid not in _session_ids(rotated, GLOBEX)

    # Removed from the settings: no key of acme opens anything; its data stays in Redis.
    with serving(redis_server.url, prefix, {"globex": GLOBEX}) as removed:
        assert _status(removed, K1) == 401 and _status(removed, K2) == 401
        assert _status(removed, GLOBEX) == 200
        with _http(removed, GLOBEX) as globex:
            assert globex.get(f"/sessions/{sid}").status_code == 404
        assert raw_redis.exists(f"{prefix}:session:{{{sid}}}")

    # Configured again (with yet another key): the same tenant, with everything it had.
    with serving(redis_server.url, prefix, {"acme": K1}) as back:
        with _http(back, K1) as acme:
            assert acme.get(f"/sessions/{sid}/messages").json() == history
    # No key is kept in Redis, hashed or not.
    assert list(raw_redis.scan_iter(match=f"{prefix}:apikey:*")) == []


def test_replicas_on_one_redis_each_admit_their_own_keys(redis_server, prefix):
    from chatsvc.api.app import create_app

    one = {"acme": K1, "initech": INITECH_1}
    two = {"acme": K2, "initech": INITECH_2}
    replicas = [
        ThreadServer(create_app(_settings(redis_server.url, prefix, keys))) for keys in (one, two)
    ]
    try:
        # Started together: both may create "initech" at once and must agree on it.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first, second = pool.map(ThreadServer.__enter__, replicas)

        for server, mine, other in ((first, K1, K2), (second, K2, K1)):
            assert _status(server, mine) == 200
            assert _status(server, other) == 401  # the other replica's key
        acme = {s.services.tenants.tenant_for_key(k).id for s, k in ((first, K1), (second, K2))}
        assert len(acme) == 1
        initech = {
            s.services.tenants.tenant_for_key(k).id
            for s, k in ((first, INITECH_1), (second, INITECH_2))
        }
        assert len(initech) == 1

        # A session made through one replica is the tenant's on the other.
        with _http(first, INITECH_1) as http:
            sid = new_session(http)["id"]
        assert sid in _session_ids(second, INITECH_2)
    finally:
        for replica in replicas:
            if replica.server.started:
                replica.__exit__(None, None, None)


def test_prompt_caps_answer_429_and_write_nothing(redis_server, raw_redis):
    prefix = unique_prefix("caps")
    with serving(redis_server.url, prefix, {"acme": K1}) as server:
        with _http(server, K1) as acme, _http(server, ADMIN) as admin:
            for n in range(2):
                body = {"name": f"p{n}", "text": f"Be {n}."}
                created = acme.post("/system-prompts", json=body)
                assert created.status_code == 201, created.text
            published = admin.post("/admin/system-prompts", json={"name": "s", "text": "All."})
            assert published.status_code == 201, published.text
            before = http_helpers.keyspace(raw_redis, prefix)

            over = acme.post("/system-prompts", json={"name": "p2", "text": "Be 2."})
            assert over.status_code == 429, over.text
            assert over.json()["error"]["type"] == "rate_limit_error"
            shared = admin.post("/admin/system-prompts", json={"name": "t", "text": "Two."})
            assert shared.status_code == 429, shared.text
            assert http_helpers.keyspace(raw_redis, prefix) == before

            # Deleting one makes room again.
            listed = acme.get("/system-prompts").json()["system_prompts"]
            own = [p["id"] for p in listed if not p["shared"]]
            assert len(own) == 2
            assert acme.delete(f"/system-prompts/{own[0]}").status_code == 204
            again = acme.post("/system-prompts", json={"name": "p3", "text": "Be 3."})
            assert again.status_code == 201, again.text
