from __future__ import annotations

import pytest

from chatsvc.store import Store
from tests.redis_server import unique_prefix

# redis_server and anyio_backend come from tests/conftest.py.


@pytest.fixture
def prefix() -> str:
    return unique_prefix("store")


@pytest.fixture
async def store(redis_server, prefix):
    store = await Store.connect(redis_server.url, prefix=prefix)
    yield store
    await store.close()


@pytest.fixture
async def raw(redis_server):
    """A plain redis-py client on the same server, to look behind the store's back."""
    import redis.asyncio as aredis

    client = aredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()
