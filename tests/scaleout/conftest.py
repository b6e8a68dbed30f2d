"""Fixtures of the scale-out suite: two real replicas behind the shipped nginx config.

The replicas are ``chatsvc serve`` child processes (real model) sharing the
session-wide Redis under a key prefix of their own; nginx is Debian's, installed
when missing (by ``./dev test`` or here). Where it cannot be installed the suite
skips, saying why, except in CI (``CI=true``): there a missing component fails
the run, so CI can never go green by not running these tests.
"""

from __future__ import annotations

import time

import httpx
import pytest

from bench.scaleout.fleet import Fleet
from bench.scaleout.nginx import NginxUnavailable, ensure_nginx
from tests.components import missing_component
from tests.redis_server import unique_prefix

ACME_KEY = "acme-scaleout-key-0001"
GLOBEX_KEY = "globex-scaleout-key-0002"
CAROL_KEY = "carol-scaleout-key-0003"
API_KEYS = {"acme": ACME_KEY, "globex": GLOBEX_KEY, "carol": CAROL_KEY}
MAX_SESSIONS = 40
SESSION_TTL_S = 3600
# Short, so a killed replica's turn lock frees itself within a few seconds.
TURN_LOCK_TTL_S = 5


@pytest.fixture(scope="session")
def nginx_binary() -> str:
    try:
        return ensure_nginx()
    except NginxUnavailable as exc:
        missing_component(f"nginx cannot be installed here: {exc}")


@pytest.fixture(scope="module")
def fleet(nginx_binary, redis_server, tmp_path_factory):
    env = {
        "CHATSVC_MAX_SESSIONS_PER_TENANT": str(MAX_SESSIONS),
        "CHATSVC_SESSION_TTL_S": str(SESSION_TTL_S),
        "CHATSVC_TURN_LOCK_TTL_S": str(TURN_LOCK_TTL_S),
    }
    live = Fleet(
        tmp_path_factory.mktemp("fleet"),
        redis_server.url,
        prefix=unique_prefix("fleet"),
        api_keys=API_KEYS,
        env=env,
    )
    with live:
        live.prefix = live.replicas[0].env["CHATSVC_KEY_PREFIX"]
        yield live


def client(base_url: str, key: str = ACME_KEY, **headers: str) -> httpx.Client:
    return httpx.Client(
        base_url=base_url, headers={"Authorization": f"Bearer {key}", **headers}, timeout=300
    )


def turn(http: httpx.Client, session_id: str, text: str, max_tokens: int = 4) -> httpx.Response:
    body = {"content": text, "max_tokens": max_tokens, "temperature": 0}
    return http.post(f"/sessions/{session_id}/messages", json=body)


def turn_ok(http: httpx.Client, session_id: str, text: str, max_tokens: int = 4) -> dict:
    response = turn(http, session_id, text, max_tokens)
    assert response.status_code == 200, response.text
    return response.json()


def turn_when_free(http: httpx.Client, session_id: str, text: str, timeout_s: float = 120) -> dict:
    """A turn that waits out 409s (a dead replica's turn lock expiring), as a client would."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = turn(http, session_id, text)
        if response.status_code != 409 or time.monotonic() > deadline:
            assert response.status_code == 200, response.text
            return response.json()
        time.sleep(0.2)
