"""One live API server for the whole API suite: real model, real Redis, real HTTP.

Two tenants (acme, globex) and an admin key. Tests create their own sessions
and use unique texts, so they do not depend on each other's order.
"""

from __future__ import annotations

import httpx
import pytest

from bench.live_server import ThreadServer
from chatsvc.config import Limits, Settings
from tests import http_helpers, live_service
from tests.http_helpers import keyspace, new_session, say, unique  # noqa: F401 - re-exported
from tests.live_service import BLOCK_SIZE, MAX_MODEL_LEN, tenant_client  # noqa: F401 - re-exported
from tests.redis_server import unique_prefix

ACME_KEY = "acme-secret-key-0001"
GLOBEX_KEY = "globex-secret-key-0002"
ADMIN_KEY = "admin-secret-key-0003"


def engine_config():
    return live_service.engine_config(num_gpu_blocks=512, num_host_blocks=64)


TEST_LIMITS = Limits(
    max_body_bytes=64_000,
    max_message_chars=8_000,
    max_tokens_cap=64,
    max_n=4,
    max_sessions_per_tenant=1_000,
    max_streams_per_tenant=4,
    # Small, so a refused answer is cheap to ask for (test_api_response_size.py).
    max_response_bytes=500_000,
    # One shared server, and tests that loop over hundreds of requests of one tenant;
    # the request rate has its own server (tests/reliability/test_request_rate.py).
    tenant_requests_per_s=0,
)


@pytest.fixture(scope="session")
def api(redis_server):
    settings = Settings(
        redis_url=redis_server.url,
        key_prefix=unique_prefix("api"),
        admin_key=ADMIN_KEY,
        api_keys=(("acme", ACME_KEY), ("globex", GLOBEX_KEY)),
        limits=TEST_LIMITS,
        engine=engine_config(),
    )
    from chatsvc.api.app import create_app

    with ThreadServer(create_app(settings)) as server:
        yield server


def client(api, key: str | None) -> httpx.Client:
    return http_helpers.client(api.url, key, timeout_s=300)


acme = tenant_client("api", ACME_KEY, timeout_s=300)
globex = tenant_client("api", GLOBEX_KEY, timeout_s=300)
admin = tenant_client("api", ADMIN_KEY, timeout_s=300)
