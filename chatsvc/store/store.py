"""The session store: tenants, system prompts, sessions and their messages in Redis.

One ``Store`` per process, shared by every request. It is nothing but its
collaborators, each a module of one concept over the one ``StoreContext``
(the client, the key schema, the scripts, the settings):

    store.tenants     Tenants     tenants.py     tenants by name
    store.prompts     Prompts     prompts.py     private and shared system prompts
    store.sessions    Sessions    sessions.py    create, read, list, delete; the turn lock
    store.tree        Tree        tree_read.py   branches, messages, histories (reads)
    store.branches    Branches    branches.py    turns, items, branch switches, deletes, metadata
    store.responses   Responses   responses.py   the Responses API's records

The writes of ``branches`` and ``responses`` share one read -> plan -> apply
loop (``TreeWriter``, writes.py). Ids handed in by callers are checked before
use; an id that belongs to another tenant behaves exactly like an unknown one
(None / False / NotFoundError), so ids leak nothing.
"""

from __future__ import annotations

import redis.asyncio as aredis

from chatsvc.store.branches import Branches
from chatsvc.store.commit import Quotas
from chatsvc.store.connection import make_client, unavailable_on_failure
from chatsvc.store.context import StoreContext
from chatsvc.store.keys import Keys
from chatsvc.store.prompts import Prompts
from chatsvc.store.responses import Responses
from chatsvc.store.schema import apply_pending
from chatsvc.store.sessions import Sessions
from chatsvc.store.tenants import Tenants
from chatsvc.store.tree_read import Tree
from chatsvc.store.writes import TreeWriter


class Store:
    """The store's collaborators over one connection; see ``Store.connect`` to build one."""

    def __init__(self, context: StoreContext) -> None:
        self.context = context
        self.tenants = Tenants(context)
        self.prompts = Prompts(context, self.tenants)
        self.sessions = Sessions(context, self.tenants, self.prompts)
        self.tree = Tree(context)
        writer = TreeWriter(context, self.tree)
        self.branches = Branches(context, self.tree, writer)
        self.responses = Responses(context, self.tree, writer, self.branches)

    @property
    def redis(self) -> aredis.Redis:
        """The client every collaborator shares (health checks ping it)."""
        return self.context.redis

    @property
    def keys(self) -> Keys:
        """The key schema of this store's prefix."""
        return self.context.keys

    @classmethod
    async def connect(
        cls,
        url: str,
        prefix: str = "chatsvc",
        session_ttl_s: float | None = None,
        *,
        lock_ttl_s: float = 30.0,
        socket_timeout_s: float = 2.0,
        client_name: str | None = None,
        max_session_bytes: int | None = None,
        max_tenant_bytes: int | None = None,
    ) -> Store:
        """Connect to ``url``, apply pending migrations under a lock, return the store.

        ``session_ttl_s``: idle sessions expire this long after their last use
        (None: never). ``lock_ttl_s``: a turn lock whose holder died frees itself
        after this long, or as soon as its instance's presence key lapses (within
        ``presence.ALIVE_TTL_S``, or ``lock_ttl_s`` if shorter). ``max_session_bytes``
        / ``max_tenant_bytes``: the most bytes one session / one tenant may store (None:
        unbounded); a write past either raises ``StorageQuotaError``. Raises
        ``StoreUnavailableError`` if Redis is unreachable.
        """
        keys = Keys(prefix)
        client = make_client(url, socket_timeout_s=socket_timeout_s, client_name=client_name)
        try:
            context = StoreContext.over(
                client,
                url,
                keys,
                session_ttl_s=session_ttl_s,
                lock_ttl_s=lock_ttl_s,
                quotas=Quotas(max_session_bytes, max_tenant_bytes),
            )
            store = cls(context)
            with unavailable_on_failure(url):
                await client.ping()
                await apply_pending(client, keys)
                await context.presence.start()
        except BaseException:
            await client.aclose()
            raise
        return store

    async def close(self) -> None:
        """Close the connection pool; the store is unusable afterwards (its presence key
        deleted: a turn lock it still holds is free to take)."""
        await self.context.presence.stop()
        await self.context.redis.aclose()
