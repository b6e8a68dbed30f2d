"""The two writes that must happen exactly once: creating a session and committing a turn.

Each is one Lua script, so its checks and its writes are one atomic step in
Redis, and each can be sent again without harm. That matters because a reply
can be lost after Redis applied the write (a dropped connection, a failover):
redis-py then sends the same command again, and a plain MULTI/EXEC would
append the turn twice.

Why a script and not WATCH + MULTI/EXEC: a WATCH lives on one connection, so
it cannot survive the reconnect that a lost reply forces, and the retry would
have to re-read and decide again in Python. A script carries its checks with
it; the retried command is the very same check-and-write.

Commit of a turn (``append``), in this order:

1. the turn's id is among the session's recently applied turns -> "applied"
   (a resend of a write that already landed: success, nothing written);
2. the session's summary is gone -> "not_found" (deleted or expired);
3. the lock key does not hold the caller's token -> "lock_lost" (its lock
   expired, e.g. during a stall longer than the TTL, and may have been taken:
   the fencing check; nothing written);
4. the summary is not byte-for-byte the one the caller computed from
   -> "conflict" (another writer got in between; the caller reads again);
5. otherwise both messages, the new summary, the token history, the turn id,
   the index score and the TTLs are written -> "ok".

A script checks everything before its first write, so an error can never
leave half of it applied.
"""

from __future__ import annotations

import hashlib
from typing import Literal, NamedTuple

import redis.asyncio as aredis

# How many applied turn ids a session remembers. A resend arrives within the
# client's retry backoff, long before this many turns of one session (one at
# a time, under the turn lock) could have landed after it.
REMEMBERED_COMMITS = 16

Outcome = Literal["ok", "applied", "not_found", "lock_lost", "conflict"]

# The shebang makes Redis check for out-of-memory once, before the script
# runs, instead of refusing a write halfway through it.
_APPEND = f"""#!lua
if redis.call('lpos', KEYS[4], ARGV[1]) then
    return 'applied'
end
local summary = redis.call('get', KEYS[1])
if not summary then
    return 'not_found'
end
if redis.call('get', KEYS[5]) ~= ARGV[2] then
    return 'lock_lost'
end
if redis.sha1hex(summary) ~= ARGV[3] then
    return 'conflict'
end
redis.call('rpush', KEYS[3], ARGV[9], ARGV[10])
redis.call('set', KEYS[1], ARGV[4])
redis.call('set', KEYS[2], ARGV[5])
redis.call('lpush', KEYS[4], ARGV[1])
redis.call('ltrim', KEYS[4], 0, {REMEMBERED_COMMITS - 1})
redis.call('zadd', KEYS[6], ARGV[7], ARGV[6])
if ARGV[8] ~= '' then
    for i = 1, 4 do
        redis.call('pexpire', KEYS[i], ARGV[8])
    end
end
return 'ok'
"""

# Session ids are 128 random bits made by the store, so a summary already
# under the new id can only be this very create, landed before its reply was lost.
_CREATE = """#!lua
if redis.call('exists', KEYS[1]) == 1 then
    return 'applied'
end
redis.call('set', KEYS[1], ARGV[1])
redis.call('set', KEYS[2], ARGV[2])
if ARGV[6] then
    redis.call('rpush', KEYS[3], ARGV[6])
end
redis.call('zadd', KEYS[4], ARGV[4], ARGV[3])
if ARGV[5] ~= '' then
    for i = 1, 3 do
        redis.call('pexpire', KEYS[i], ARGV[5])
    end
end
return 'ok'
"""


class SessionKeys(NamedTuple):
    """The keys one session's writes touch (all but ``index`` share its hash tag)."""

    summary: str
    tokens: str
    messages: str
    commits: str
    lock: str
    index: str  # the tenant's session index


def fingerprint(raw_summary: bytes) -> str:
    """What ``append`` compares the stored summary against (the hex sha1 Redis computes)."""
    return hashlib.sha1(raw_summary).hexdigest()


class CommitScripts:
    """The create and append scripts, registered on one client."""

    def __init__(self, client: aredis.Redis) -> None:
        self._append = client.register_script(_APPEND)
        self._create = client.register_script(_CREATE)

    async def create(
        self,
        keys: SessionKeys,
        *,
        session_id: str,
        summary: bytes,
        tokens: bytes,
        score: float,
        ttl_ms: int | None,
        system_message: bytes | None,
    ) -> Outcome:
        """Write a new session unless it exists: "ok", or "applied" for a resend."""
        args = [summary, tokens, session_id, repr(score), "" if ttl_ms is None else ttl_ms]
        if system_message is not None:
            args.append(system_message)
        reply = await self._create(
            keys=[keys.summary, keys.tokens, keys.messages, keys.index], args=args
        )
        return _outcome(reply)

    async def append(
        self,
        keys: SessionKeys,
        *,
        session_id: str,
        turn_id: str,
        lock_token: str,
        read_fingerprint: str,
        summary: bytes,
        tokens: bytes,
        score: float,
        ttl_ms: int | None,
        messages: tuple[bytes, bytes],
    ) -> Outcome:
        """Commit one turn under the checks in the module docstring; the outcome."""
        reply = await self._append(
            keys=list(keys),
            args=[
                turn_id,
                lock_token,
                read_fingerprint,
                summary,
                tokens,
                session_id,
                repr(score),
                "" if ttl_ms is None else ttl_ms,
                *messages,
            ],
        )
        return _outcome(reply)


def _outcome(reply: bytes | str) -> Outcome:
    outcome = reply.decode() if isinstance(reply, bytes) else reply
    if outcome not in ("ok", "applied", "not_found", "lock_lost", "conflict"):
        raise RuntimeError(f"unexpected reply from a commit script: {reply!r}")
    return outcome
