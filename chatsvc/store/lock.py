"""A single-holder Redis lock: SET NX PX with a random token, compare-and-delete release.

The expiry means a holder that dies never blocks the key for longer than the
TTL; the random token means a holder whose lock already expired cannot release
or extend the lock someone else took since.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

import redis.asyncio as aredis

log = logging.getLogger(__name__)

_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""

_EXTEND = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""


class RedisLock:
    """One attempt-to-hold of ``key``; create a new object per acquisition."""

    def __init__(self, client: aredis.Redis, key: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lock ttl must be > 0 seconds, got {ttl_s}")
        self._client = client
        self.key = key
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.token = secrets.token_hex(16)
        self._release = client.register_script(_RELEASE)
        self._extend = client.register_script(_EXTEND)

    async def acquire(self) -> bool:
        """Take the lock if free; False if someone holds it. Never waits."""
        if await self._client.set(self.key, self.token, nx=True, px=self.ttl_ms):
            return True
        # A SET whose reply was lost is sent again by redis-py and then finds the
        # key taken, by this very token: that is an acquisition, not a busy lock.
        return await self._client.get(self.key) == self.token.encode()

    async def release(self) -> bool:
        """Delete the lock if this object still holds it; False if it had expired."""
        return bool(await self._release(keys=[self.key], args=[self.token]))

    async def extend(self) -> bool:
        """Reset the TTL if this object still holds the lock; False if it was lost."""
        return bool(await self._extend(keys=[self.key], args=[self.token, self.ttl_ms]))


async def _keep_alive(lock: RedisLock) -> None:
    # Extending at a third of the TTL leaves two chances before expiry, so one
    # slow round trip does not hand the lock to someone else mid-turn.
    interval = lock.ttl_ms / 3000
    while True:
        await asyncio.sleep(interval)
        try:
            if not await lock.extend():
                log.warning("lock %s was lost (expired or deleted) while held", lock.key)
                return
        except Exception as exc:  # keep trying: Redis may come back before the TTL runs out
            log.warning("could not extend lock %s: %s", lock.key, exc)


@contextlib.asynccontextmanager
async def keep_held(lock: RedisLock):
    """Keep an acquired ``lock`` for the block, extending it while the block runs.

    On exit (normal or exception) the lock is released; if Redis is unreachable
    then, the TTL frees it instead and the block's own exception, if any, is the
    one that propagates.
    """
    refresher = asyncio.create_task(_keep_alive(lock))
    try:
        yield lock
    finally:
        refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresher
        try:
            await lock.release()
        except Exception as exc:
            log.warning("could not release lock %s (it expires on its own): %s", lock.key, exc)
