"""A single-holder Redis lock: SET NX PX with a random token, compare-and-delete release.

The expiry means a holder that dies never blocks the key for longer than the
TTL; the random token means a holder whose lock already expired cannot release
or extend the lock someone else took since. A lock made with a ``Presence`` puts its
instance's id in the token, ``<instance id>:<random>``: a lock whose holder's
instance is gone (its presence key lapsed) is taken over at once instead of after
the TTL (``presence.py`` says why that is safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

import redis.asyncio as aredis

from chatsvc.store.presence import Presence

log = logging.getLogger(__name__)

_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""

# Take the lock over from a holder whose instance is gone: only if it still holds the
# token seen (nobody took or released it since) and the holder's presence key is absent.
_TAKE_OVER = """
if redis.call('get', KEYS[1]) == ARGV[1] and redis.call('exists', KEYS[2]) == 0 then
    redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3])
    return 1
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
    """One attempt-to-hold of ``key``; create a new object per acquisition. ``presence``:
    this instance's (``presence.py``), so a holder that is gone can be told from a live one."""

    def __init__(
        self, client: aredis.Redis, key: str, ttl_s: float, presence: Presence | None = None
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lock ttl must be > 0 seconds, got {ttl_s}")
        self._client = client
        self.key = key
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._presence = presence
        random = secrets.token_hex(16)
        self.token = random if presence is None else f"{presence.instance_id}:{random}"
        self._release = client.register_script(_RELEASE)
        self._extend = client.register_script(_EXTEND)
        self._take_over = client.register_script(_TAKE_OVER)

    async def acquire(self) -> bool:
        """Take the lock if free, or held by an instance that is gone; False if a live
        holder (or one of unknown instance) has it. Never waits."""
        if await self._client.set(self.key, self.token, nx=True, px=self.ttl_ms):
            return True
        held = await self._client.get(self.key)
        # A SET whose reply was lost is sent again by redis-py and then finds the
        # key taken, by this very token: that is an acquisition, not a busy lock.
        if held == self.token.encode():
            return True
        holder = _instance_of(held)
        if holder is None or self._presence is None:
            return False
        alive = self._presence.key_of(holder)
        args = [held, self.token, self.ttl_ms]
        if not await self._take_over(keys=[self.key, alive], args=args):
            return False
        log.warning("took over lock %s from instance %s, which is gone", self.key, holder)
        return True

    async def release(self) -> bool:
        """Delete the lock if this object still holds it; False if it had expired."""
        return bool(await self._release(keys=[self.key], args=[self.token]))

    async def extend(self) -> bool:
        """Reset the TTL if this object still holds the lock; False if it was lost."""
        return bool(await self._extend(keys=[self.key], args=[self.token, self.ttl_ms]))


def _instance_of(token: bytes | None) -> str | None:
    """The instance id a lock token names (None: no token, or one made without presence)."""
    if not token or b":" not in token:
        return None
    holder = token.split(b":", 1)[0].decode("ascii", "replace")
    return holder if holder.isalnum() else None


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
