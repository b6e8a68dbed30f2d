"""Applies numbered keyspace migrations once, in order, under a Redis lock.

The newest applied migration number lives under ``Keys.schema_version()``.
Replicas starting together race for ``Keys.migration_lock()``; the loser waits
until the winner is done and then finds nothing pending, so each migration
runs once. A migration bumps the version only after it finished, so one that
was interrupted runs again from the start: every migration must be idempotent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import redis.asyncio as aredis

from chatsvc.store.connection import make_client, unavailable_on_failure
from chatsvc.store.errors import SchemaVersionError, StoreError
from chatsvc.store.keys import Keys
from chatsvc.store.lock import RedisLock, keep_held


class Migration(NamedTuple):
    """One keyspace change; ``up`` must be safe to run again after a partial run."""

    version: int
    name: str
    up: Callable[[aredis.Redis, Keys], Awaitable[None]]

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"


def all_migrations() -> tuple[Migration, ...]:
    """Every migration, oldest first."""
    from migrations import (
        m0001_initial,
        m0002_session_index_zset,
        m0003_tenant_names_and_operator_prompts,
        m0004_session_tokens_key,
        m0005_message_tree,
    )

    return (
        m0001_initial.MIGRATION,
        m0002_session_index_zset.MIGRATION,
        m0003_tenant_names_and_operator_prompts.MIGRATION,
        m0004_session_tokens_key.MIGRATION,
        m0005_message_tree.MIGRATION,
    )


async def current_version(client: aredis.Redis, keys: Keys) -> int:
    """The newest migration applied to this keyspace (0 for a fresh one)."""
    raw = await client.get(keys.schema_version())
    return 0 if raw is None else int(raw)


async def apply_pending(
    client: aredis.Redis,
    keys: Keys,
    *,
    lock_ttl_s: float = 30.0,
    wait_s: float = 120.0,
    poll_s: float = 0.05,
) -> list[str]:
    """Apply every migration newer than the keyspace; returns the labels applied here.

    Raises ``SchemaVersionError`` if the keyspace is newer than this code, and
    ``StoreError`` if another runner holds the lock for longer than ``wait_s``.
    """
    migrations = all_migrations()
    latest = migrations[-1].version
    deadline = time.monotonic() + wait_s
    while True:
        version = await current_version(client, keys)
        if version > latest:
            raise SchemaVersionError(
                f"keyspace {keys.prefix!r} is at schema version {version}, "
                f"newer than this chatsvc knows ({latest}); upgrade chatsvc"
            )
        if version == latest:
            return []
        lock = RedisLock(client, keys.migration_lock(), lock_ttl_s)
        if await lock.acquire():
            break
        if time.monotonic() > deadline:
            raise StoreError(
                f"another process has held {keys.migration_lock()!r} for over {wait_s:.0f}s"
            )
        await asyncio.sleep(poll_s)

    applied: list[str] = []
    async with keep_held(lock):
        # Re-read under the lock: the previous holder may have finished in between.
        version = await current_version(client, keys)
        for migration in migrations:
            if migration.version <= version:
                continue
            await migration.up(client, keys)
            await client.set(keys.schema_version(), migration.version)
            applied.append(migration.label)
    return applied


async def migrate(url: str, prefix: str = "chatsvc") -> list[str]:
    """Connect to ``url`` and apply pending migrations under ``prefix``.

    This is what ``python -m chatsvc migrate`` calls; it returns the labels of
    the migrations applied by this call (empty when the keyspace was current).
    """
    keys = Keys(prefix)
    client = make_client(url)
    try:
        with unavailable_on_failure(url):
            return await apply_pending(client, keys)
    finally:
        await client.aclose()
