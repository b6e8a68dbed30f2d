"""Replicas that start at the same moment on one Redis: each must come up."""

from __future__ import annotations

import asyncio

import pytest

from chatsvc.config import Settings
from chatsvc.service import bootstrap_tenants
from chatsvc.store import Store
from tests.redis_server import unique_prefix

pytestmark = pytest.mark.anyio


async def test_replicas_bootstrapping_the_same_tenants_at_once_all_start(redis_server):
    prefix = unique_prefix("boot")
    settings = Settings(
        api_keys=(("acme", "acme-boot-key-00001"), ("globex", "globex-boot-key-0002"))
    )
    stores = [await Store.connect(redis_server.url, prefix=prefix) for _ in range(4)]
    try:
        # Four replicas race through the same look-up-then-create.
        await asyncio.gather(*(bootstrap_tenants(s, settings) for s in stores))
        for name, key in settings.api_keys:
            tenant = await stores[0].tenant_by_api_key(key)
            assert tenant is not None and tenant.name == name
        ids = await stores[0].redis.keys(f"{prefix}:tenant:*")
        assert len([k for k in ids if k.count(b":") == 2]) == 2  # one record per tenant
    finally:
        for store in stores:
            await store.close()
