"""``peek_session``: reading a session on another's behalf leaves its idle TTL alone.

Deleting a session compares its tokens with the tenant's other sessions (what
they share keeps its KV); that read must not keep those sessions alive.
"""

from __future__ import annotations

import pytest

from chatsvc.store import Store
from tests.store.helpers import new_tenant

pytestmark = pytest.mark.anyio


async def test_peek_reads_the_tokens_without_refreshing_the_ttl(redis_server, prefix, raw):
    store = await Store.connect(redis_server.url, prefix=prefix, session_ttl_s=600.0)
    try:
        tenant = await new_tenant(store)
        other = await new_tenant(store)
        session = await store.sessions.create(tenant.id, None, "sys", [7, 8, 9], {})
        key = f"{prefix}:session:{{{session.id}}}"
        # Shorten the TTL by hand: a refresh would set it back to 600 s.
        await raw.pexpire(key, 50_000)

        peeked = await store.sessions.peek(tenant.id, session.id)
        assert peeked is not None and peeked.token_ids == [7, 8, 9]
        assert 0 < await raw.pttl(key) <= 50_000
        assert await store.sessions.peek(other.id, session.id) is None

        await store.sessions.get(tenant.id, session.id)  # the control: this one refreshes
        assert await raw.pttl(key) > 50_000
    finally:
        await store.close()
