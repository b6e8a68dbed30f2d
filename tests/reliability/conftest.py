"""A live service for the reliability suites: real model, real Redis, real HTTP.

One server for the whole test session, with tight limits so that hostile input
and limit tests are cheap, and four tenants so that suites do not share state:

- ``acme`` and ``globex``: ordinary tenants (isolation, concurrency, logs);
- ``fuzz``: the schema-driven fuzzer's tenant (it creates sessions at random);
- ``carol``: the tenant that runs into the per-tenant limits on purpose.

Tests create their own sessions and use unique texts, so they do not depend on
each other's order. ``start_server`` starts another one with other limits.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import httpx
import pytest

from bench.live_server import ThreadServer
from chatsvc.config import Limits, Settings
from tests import http_helpers, live_service
from tests.http_helpers import keyspace, new_session, unique  # noqa: F401 - re-exported
from tests.live_service import tenant_client
from tests.redis_server import unique_prefix

ACME_KEY = "acme-reliability-key-01"
GLOBEX_KEY = "globex-reliability-key-02"
FUZZ_KEY = "fuzz-reliability-key-03"
CAROL_KEY = "carol-reliability-key-04"
ADMIN_KEY = "admin-reliability-key-05"
TENANT_KEYS = {"acme": ACME_KEY, "globex": GLOBEX_KEY, "fuzz": FUZZ_KEY, "carol": CAROL_KEY}

# Small caps keep every generation short (the fuzzer sends thousands of requests
# on two cores) and make each limit reachable by a test in a few requests.
RELIABILITY_LIMITS = Limits(
    max_body_bytes=32_000,
    max_message_chars=4_000,
    max_tokens_cap=32,
    max_n=2,
    max_sessions_per_tenant=200,
    max_streams_per_tenant=4,
    # The suites send hundreds of requests a second from one tenant (the fuzzers, the
    # side channel); the request rate has its own server (test_request_rate.py).
    tenant_requests_per_s=0,
)


def engine_config():
    return live_service.engine_config(num_gpu_blocks=384, num_host_blocks=32)


@contextlib.contextmanager
def start_server(
    redis_url: str, limits: Limits = RELIABILITY_LIMITS, engine=None
) -> Iterator[ThreadServer]:
    """A live in-process server on its own key prefix (``server.prefix``); ``engine``
    replaces the default ``engine_config()``."""
    from chatsvc.api.app import create_app

    prefix = unique_prefix("rel")
    settings = Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        admin_key=ADMIN_KEY,
        api_keys=tuple(TENANT_KEYS.items()),
        limits=limits,
        engine=engine_config() if engine is None else engine,
    )
    with ThreadServer(create_app(settings)) as server:
        server.prefix = prefix
        yield server


@pytest.fixture(scope="session")
def server(redis_server) -> Iterator[ThreadServer]:
    with start_server(redis_server.url) as live:
        yield live


def client(server: ThreadServer, key: str | None, timeout_s: float = 120) -> httpx.Client:
    return http_helpers.client(server.url, key, timeout_s)


acme = tenant_client("server", ACME_KEY)
globex = tenant_client("server", GLOBEX_KEY)
carol = tenant_client("server", CAROL_KEY)
admin = tenant_client("server", ADMIN_KEY)


# Turns here are 4 tokens: the reliability checks need a stored turn, not text.
say = functools.partial(http_helpers.say, max_tokens=4)


def cache_idle_report(admin: httpx.Client) -> dict:
    """``/admin/cache`` once no request runs: what the leak checks read."""
    response = admin.get("/admin/cache")
    assert response.status_code == 200, response.text
    return response.json()


def session_problems(server: ThreadServer, api_key: str) -> list[str]:
    """Every way a stored session of the key's tenant is half-written; empty when all are whole.

    A whole session's active branch is a chain (each message's parent the one
    before it, ending at the session's active message), its token history is its
    messages' token ids end to end (a message marked ``from_start`` holds the
    whole history so far: the turn re-rendered the conversation, e.g. after an
    answer cut inside a multi-byte character or text the tokenizer normalizes),
    and a session of the native API holds an optional system message, then
    user/assistant pairs. (Conversations and responses may hold any sequence of
    roles their items had.)
    """

    def rebuilt_history(messages) -> list[int]:
        tokens: list[int] = []
        for m in messages:
            tokens = list(m.token_ids) if m.from_start else tokens + list(m.token_ids)
        return tokens

    async def scan() -> list[str]:
        store = server.services.store
        tenant = server.services.tenants.tenant_for_key(api_key).id
        problems: list[str] = []
        cursor = None
        while True:
            summaries, cursor = await store.sessions.list_page(tenant, limit=500, cursor=cursor)
            for summary in summaries:
                # Listing hands out summaries; the token history comes with the session.
                session = await store.sessions.get(tenant, summary.id)
                if session is None:
                    continue  # deleted since the listing
                messages = await store.tree.messages(tenant, session.id) or []
                roles = [m.role for m in messages]
                if roles[:1] == ["system"]:
                    roles = roles[1:]
                if session.kind == "session" and roles != ["user", "assistant"] * (len(roles) // 2):
                    problems.append(f"{session.id}: roles {roles}")
                if session.num_messages != len(messages):
                    problems.append(f"{session.id}: num_messages {session.num_messages}")
                parents = [None, *(m.id for m in messages)][: len(messages)]
                if [m.parent_id for m in messages] != parents:
                    problems.append(f"{session.id}: the active branch is not a chain")
                if session.active_leaf != (messages[-1].id if messages else None):
                    problems.append(f"{session.id}: active message {session.active_leaf}")
                rebuilt = rebuilt_history(messages)
                if rebuilt != session.token_ids:
                    at = next(
                        (
                            i
                            for i, (x, y) in enumerate(
                                zip(rebuilt, session.token_ids, strict=False)
                            )
                            if x != y
                        ),
                        min(len(rebuilt), len(session.token_ids)),
                    )
                    problems.append(
                        f"{session.id}: token history ({len(session.token_ids)} tokens) is not "
                        f"its messages' tokens ({len(rebuilt)}); first difference at {at}: "
                        f"{[(m.role, m.text[:40], len(m.token_ids)) for m in messages]}"
                    )
            if cursor is None:
                return problems

    return server.call(scan())
