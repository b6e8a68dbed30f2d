"""An instance's presence in Redis: a key it keeps alive while it runs.

A turn lock carries its holder's instance id (``RedisLock``). When a replica dies
mid-turn, its lock would block the session for the rest of the lock's TTL (30 s by
default): the client's retry, sent to another replica or to the restarted one, gets
409s. With presence, the retry finds the holder's key gone within ``ALIVE_TTL_S`` and
takes the lock over at once (``RedisLock.acquire``). A live holder's key never lapses
while its event loop runs, so a live turn is never taken over; one whose loop stalls
past ``ALIVE_TTL_S`` may be, and then its commit is refused as for an expired lock
(fencing by token, ``commit.py``), so no write is ever lost or doubled by it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

import redis.asyncio as aredis

from chatsvc.store.keys import Keys

log = logging.getLogger(__name__)

# How long an instance's key outlives its last refresh: the longest a dead holder's turn
# lock blocks its session. Refreshed at a third of it, so one slow round trip is harmless.
ALIVE_TTL_S = 5.0


class Presence:
    """This instance's id and the key that says it runs; ``start`` it, ``stop`` it."""

    def __init__(self, client: aredis.Redis, keys: Keys, ttl_s: float = ALIVE_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError(f"presence ttl must be > 0 seconds, got {ttl_s}")
        self._client = client
        self._keys = keys
        self.instance_id = secrets.token_hex(8)
        self.key = keys.instance_alive(self.instance_id)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._task: asyncio.Task[None] | None = None

    def key_of(self, instance_id: str) -> str:
        """The presence key of any instance (a lock's holder)."""
        return self._keys.instance_alive(instance_id)

    async def start(self) -> None:
        """Say this instance runs, and keep saying it until ``stop``."""
        await self._client.set(self.key, b"1", px=self.ttl_ms)
        self._task = asyncio.create_task(self._keep_alive())

    async def stop(self) -> None:
        """Stop refreshing and delete the key: this instance's locks are free to take."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            await self._client.delete(self.key)
        except Exception as exc:  # it expires on its own
            log.warning("could not delete presence key %s: %s", self.key, exc)

    async def _keep_alive(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            try:
                await self._client.set(self.key, b"1", px=self.ttl_ms)
            except Exception as exc:  # Redis may come back before the key lapses
                if not failing:
                    log.warning("could not refresh presence key %s: %s", self.key, exc)
                failing = True
            else:
                failing = False
