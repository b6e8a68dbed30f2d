"""The writes that must happen exactly once: creating a session and changing its tree.

Each is one Lua script, so its checks and its writes are one atomic step in
Redis, and each can be sent again without harm. That matters because a reply
can be lost after Redis applied the write (a dropped connection, a failover):
redis-py then sends the same command again, and a plain MULTI/EXEC would
append the turn twice.

Why a script and not WATCH + MULTI/EXEC: a WATCH lives on one connection, so
it cannot survive the reconnect that a lost reply forces, and the retry would
have to re-read and decide again in Python. A script carries its checks with
it; the retried command is the very same check-and-write.

Every change to a session's messages after its creation (a turn, a branch
switch, a deleted branch or item, added items, new metadata, a deleted
response) is one ``TreeWrite`` applied by ``apply``, in this order:

1. the write's id is among the session's recently applied writes -> "applied"
   (a resend of a write that already landed: success, nothing written);
2. the session's summary is gone -> "not_found" (deleted or expired);
3. the lock key does not hold the caller's token -> "lock_lost" (its lock
   expired, e.g. during a stall longer than the TTL, and may have been taken:
   the fencing check; nothing written);
4. the summary is not byte-for-byte the one the caller computed from
   -> "conflict" (another writer got in between; the caller reads again);
5. the write would take the session's stored bytes past ``max_session_bytes``
   -> "session_quota", or the tenant's past ``max_tenant_bytes`` ->
   "tenant_quota" (nothing written; a write that frees bytes always passes);
6. otherwise the new summary, token history, messages, child lists, active
   path, responses, the write's id, the index score, the byte counters and
   the TTLs are written -> "ok".

A script parses all of its arguments before its first write, so an error can
never leave half of it applied.

Byte accounting. A session's stored bytes are the lengths of its token
history and of every value of its ``nodes`` and ``responses`` hashes (the
text, token ids and records; child lists, the path and the summary are ids
and counts, bounded by the message count). The tenant's ``bytes`` hash keeps
each session's figure and their sum under ``TOTAL``. The scripts measure what
they replace (STRLEN, HSTRLEN) before writing, so the counters move by exactly
what the write changes, in the same atomic step: they cannot drift.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import redis.asyncio as aredis

from chatsvc.store.keys import Keys

# How many applied write ids a session remembers. A resend arrives within the
# client's retry backoff, long before this many writes of one session (one at
# a time, under the turn lock) could have landed after it.
REMEMBERED_COMMITS = 16

Outcome = Literal[
    "ok", "applied", "not_found", "lock_lost", "conflict", "limit", "session_quota", "tenant_quota"
]

# The field of a tenant's bytes hash holding the sum; ids match [A-Za-z0-9_-], so
# no session id can take it.
TOTAL = "*total"

# Redis reads a script's ARGV into Lua's stack; sets and deletes go in chunks
# this size so no single call passes Lua's argument limit.
_LUA_HELPERS = (
    f"local TOTAL = '{TOTAL}'\n"
    + """
local function take(args, i)
    local n = tonumber(args[i])
    local items = {}
    for j = 1, n do items[j] = args[i + j] end
    return items, i + n + 1
end
local function take_pairs(args, i)
    local n = tonumber(args[i])
    local items = {}
    for j = 1, 2 * n do items[j] = args[i + j] end
    return items, i + 2 * n + 1
end
local function each_chunk(items, size, fn)
    for start = 1, #items, size do
        fn(unpack(items, start, math.min(start + size - 1, #items)))
    end
end
-- The bytes a hash gains when ``dels`` go and ``sets`` (pairs) are written, dels first.
local function hash_delta(key, sets, dels)
    local delta = 0
    local gone = {}
    for _, field in ipairs(dels) do
        if not gone[field] then
            delta = delta - redis.call('hstrlen', key, field)
            gone[field] = true
        end
    end
    for j = 1, #sets, 2 do
        local old = 0
        if not gone[sets[j]] then
            old = redis.call('hstrlen', key, sets[j])
        end
        delta = delta + #sets[j + 1] - old
        gone[sets[j]] = true
    end
    return delta
end
-- 'session_quota' / 'tenant_quota' when adding ``delta`` bytes to session ``sid``
-- passes a limit ('' = none), else false. Freeing bytes always passes.
local function over_quota(counters, sid, delta, max_session, max_tenant)
    if delta <= 0 then
        return false
    end
    local used = tonumber(redis.call('hget', counters, sid) or '0')
    if max_session ~= '' and used + delta > tonumber(max_session) then
        return 'session_quota'
    end
    local total = tonumber(redis.call('hget', counters, TOTAL) or '0')
    if max_tenant ~= '' and total + delta > tonumber(max_tenant) then
        return 'tenant_quota'
    end
    return false
end
local function count_bytes(counters, sid, delta)
    if delta ~= 0 then
        redis.call('hincrby', counters, sid, delta)
        redis.call('hincrby', counters, TOTAL, delta)
    end
end
"""
)

# KEYS: summary, tokens, nodes, children, path, responses, commits, lock, index,
#       the tenant's bytes hash
# ARGV: write id, lock token, fingerprint, session id, score, ttl ms ('' = none),
#       summary ('' = delete the session), tokens flag ('1' = set), tokens,
#       path keep (-1 = the path stays as it is), max session bytes, max tenant
#       bytes ('' = none), then counted lists: path tail, node sets (pairs),
#       node deletes, child sets (pairs), child deletes, response sets (pairs),
#       response deletes.
# The shebang makes Redis check for out-of-memory once, before the script runs,
# instead of refusing a write halfway through it.
_APPLY = (
    "#!lua\n"
    + _LUA_HELPERS
    + f"""
if redis.call('lpos', KEYS[7], ARGV[1]) then
    return 'applied'
end
local summary = redis.call('get', KEYS[1])
if not summary then
    return 'not_found'
end
if redis.call('get', KEYS[8]) ~= ARGV[2] then
    return 'lock_lost'
end
if redis.sha1hex(summary) ~= ARGV[3] then
    return 'conflict'
end
local i = 13
local tail, node_sets, node_dels, child_sets, child_dels, resp_sets, resp_dels
tail, i = take(ARGV, i)
node_sets, i = take_pairs(ARGV, i)
node_dels, i = take(ARGV, i)
child_sets, i = take_pairs(ARGV, i)
child_dels, i = take(ARGV, i)
resp_sets, i = take_pairs(ARGV, i)
resp_dels, i = take(ARGV, i)
if i - 1 ~= #ARGV then
    return redis.error_reply('tree write: malformed arguments')
end
if ARGV[7] == '' then
    for k = 1, 7 do
        redis.call('del', KEYS[k])
    end
    redis.call('zrem', KEYS[9], ARGV[4])
    count_bytes(KEYS[10], ARGV[4], -tonumber(redis.call('hget', KEYS[10], ARGV[4]) or '0'))
    redis.call('hdel', KEYS[10], ARGV[4])
    return 'ok'
end
local delta = hash_delta(KEYS[3], node_sets, node_dels) + hash_delta(KEYS[6], resp_sets, resp_dels)
if ARGV[8] == '1' then
    delta = delta + #ARGV[9] - redis.call('strlen', KEYS[2])
end
local refused = over_quota(KEYS[10], ARGV[4], delta, ARGV[11], ARGV[12])
if refused then
    return refused
end
redis.call('set', KEYS[1], ARGV[7])
if ARGV[8] == '1' then
    redis.call('set', KEYS[2], ARGV[9])
end
local keep = tonumber(ARGV[10])
if keep == 0 then
    redis.call('del', KEYS[5])
elseif keep > 0 then
    redis.call('ltrim', KEYS[5], 0, keep - 1)
end
each_chunk(tail, 500, function(...) redis.call('rpush', KEYS[5], ...) end)
each_chunk(node_dels, 500, function(...) redis.call('hdel', KEYS[3], ...) end)
each_chunk(node_sets, 500, function(...) redis.call('hset', KEYS[3], ...) end)
each_chunk(child_dels, 500, function(...) redis.call('hdel', KEYS[4], ...) end)
each_chunk(child_sets, 500, function(...) redis.call('hset', KEYS[4], ...) end)
each_chunk(resp_dels, 500, function(...) redis.call('hdel', KEYS[6], ...) end)
each_chunk(resp_sets, 500, function(...) redis.call('hset', KEYS[6], ...) end)
redis.call('lpush', KEYS[7], ARGV[1])
redis.call('ltrim', KEYS[7], 0, {REMEMBERED_COMMITS - 1})
redis.call('zadd', KEYS[9], ARGV[5], ARGV[4])
count_bytes(KEYS[10], ARGV[4], delta)
if ARGV[6] ~= '' then
    for k = 1, 7 do
        redis.call('pexpire', KEYS[k], ARGV[6])
    end
end
return 'ok'
"""
)

# Session ids are 128 random bits made by the store, so a summary already
# under the new id can only be this very create, landed before its reply was lost.
# The cap on the tenant's sessions is checked here, in the same atomic step as
# the write: counted first and created after, a burst of creates would all see
# room and pass it together. So are the byte quotas.
# KEYS: summary, tokens, nodes, children, path, responses, index, the tenant's bytes hash
# ARGV: summary, tokens, session id, score, ttl ms ('' = none), max session bytes,
#       max tenant bytes ('' = none), the most sessions the index may hold ('' = no
#       cap), then counted lists: node sets (pairs), child sets (pairs), path,
#       response sets (pairs).
_CREATE = (
    "#!lua\n"
    + _LUA_HELPERS
    + """
if redis.call('exists', KEYS[1]) == 1 then
    return 'applied'
end
if ARGV[8] ~= '' and redis.call('zcard', KEYS[7]) >= tonumber(ARGV[8]) then
    return 'limit'
end
local i = 9
local node_sets, child_sets, path, resp_sets
node_sets, i = take_pairs(ARGV, i)
child_sets, i = take_pairs(ARGV, i)
path, i = take(ARGV, i)
resp_sets, i = take_pairs(ARGV, i)
if i - 1 ~= #ARGV then
    return redis.error_reply('create: malformed arguments')
end
local size = #ARGV[2]
for j = 2, #node_sets, 2 do size = size + #node_sets[j] end
for j = 2, #resp_sets, 2 do size = size + #resp_sets[j] end
local refused = over_quota(KEYS[8], ARGV[3], size, ARGV[6], ARGV[7])
if refused then
    return refused
end
redis.call('set', KEYS[1], ARGV[1])
redis.call('set', KEYS[2], ARGV[2])
each_chunk(node_sets, 500, function(...) redis.call('hset', KEYS[3], ...) end)
each_chunk(child_sets, 500, function(...) redis.call('hset', KEYS[4], ...) end)
each_chunk(path, 500, function(...) redis.call('rpush', KEYS[5], ...) end)
each_chunk(resp_sets, 500, function(...) redis.call('hset', KEYS[6], ...) end)
redis.call('zadd', KEYS[7], ARGV[4], ARGV[3])
count_bytes(KEYS[8], ARGV[3], size)
if ARGV[5] ~= '' then
    for k = 1, 6 do
        redis.call('pexpire', KEYS[k], ARGV[5])
    end
end
return 'ok'
"""
)


# KEYS: the tenant's index, its bytes hash, then each session's summary key.
# ARGV: each session's id. Sessions whose summary is there are left alone.
_FORGET = f"""
for k = 1, #ARGV do
    if redis.call('exists', KEYS[k + 2]) == 0 then
        redis.call('zrem', KEYS[1], ARGV[k])
        local freed = tonumber(redis.call('hget', KEYS[2], ARGV[k]) or '0')
        redis.call('hdel', KEYS[2], ARGV[k])
        if freed ~= 0 then
            redis.call('hincrby', KEYS[2], '{TOTAL}', -freed)
        end
    end
end
return 0
"""


class SessionKeys(NamedTuple):
    """The keys one session's writes touch (all but ``index`` share its hash tag)."""

    summary: str
    tokens: str
    nodes: str
    children: str
    path: str
    responses: str
    commits: str
    lock: str
    index: str  # the tenant's session index
    counters: str  # the tenant's bytes hash

    @classmethod
    def of(cls, keys: Keys, tenant_id: str, session_id: str) -> SessionKeys:
        return cls(
            summary=keys.session(session_id),
            tokens=keys.session_tokens(session_id),
            nodes=keys.session_nodes(session_id),
            children=keys.session_children(session_id),
            path=keys.session_path(session_id),
            responses=keys.session_responses(session_id),
            commits=keys.session_commits(session_id),
            lock=keys.session_lock(session_id),
            index=keys.tenant_sessions(tenant_id),
            counters=keys.tenant_bytes(tenant_id),
        )


@dataclass
class TreeWrite:
    """One change to a session, as ``apply`` writes it.

    ``summary`` None deletes the whole session (its lock aside); ``tokens`` None
    leaves the token history as it is. The active path keeps its first
    ``path_keep`` ids (None: all of them) and gains ``path_tail``.
    """

    summary: bytes | None
    tokens: bytes | None = None
    path_keep: int | None = None
    path_tail: list[str] = field(default_factory=list)
    node_sets: dict[str, bytes] = field(default_factory=dict)
    node_dels: list[str] = field(default_factory=list)
    child_sets: dict[str, str] = field(default_factory=dict)
    child_dels: list[str] = field(default_factory=list)
    response_sets: dict[str, bytes] = field(default_factory=dict)
    response_dels: list[str] = field(default_factory=list)


@dataclass
class NewSession:
    """Everything a new session starts with, written by ``create``."""

    summary: bytes
    tokens: bytes
    node_sets: dict[str, bytes] = field(default_factory=dict)
    child_sets: dict[str, str] = field(default_factory=dict)
    path: list[str] = field(default_factory=list)
    response_sets: dict[str, bytes] = field(default_factory=dict)


def fingerprint(raw_summary: bytes) -> str:
    """What ``apply`` compares the stored summary against (the hex sha1 Redis computes)."""
    return hashlib.sha1(raw_summary).hexdigest()


def _counted(items) -> list:
    items = list(items)
    return [len(items), *items]


def _counted_pairs(mapping: dict) -> list:
    flat: list = [len(mapping)]
    for key, value in mapping.items():
        flat += [key, value]
    return flat


class Quotas(NamedTuple):
    """The most bytes one session and one tenant may store (None: unbounded)."""

    max_session_bytes: int | None = None
    max_tenant_bytes: int | None = None

    def args(self) -> list:
        return ["" if q is None else q for q in self]


UNBOUNDED = Quotas()


class CommitScripts:
    """The create, apply and forget scripts, registered on one client, under one
    ``Quotas``."""

    def __init__(self, client: aredis.Redis, quotas: Quotas = UNBOUNDED) -> None:
        self._apply = client.register_script(_APPLY)
        self._create = client.register_script(_CREATE)
        self._forget = client.register_script(_FORGET)
        self.quotas = quotas

    async def create(
        self,
        keys: SessionKeys,
        new: NewSession,
        *,
        session_id: str,
        score: float,
        ttl_ms: int | None,
        max_sessions: int | None = None,
    ) -> Outcome:
        """Write a new session unless it exists: "ok", "applied" for a resend; "limit"
        when the tenant's index already holds ``max_sessions``, or the quota it would
        pass ("session_quota", "tenant_quota"); nothing written in those."""
        args = [
            new.summary,
            new.tokens,
            session_id,
            repr(score),
            "" if ttl_ms is None else ttl_ms,
            *self.quotas.args(),
            "" if max_sessions is None else max_sessions,
            *_counted_pairs(new.node_sets),
            *_counted_pairs(new.child_sets),
            *_counted(new.path),
            *_counted_pairs(new.response_sets),
        ]
        reply = await self._create(
            keys=[keys.summary, keys.tokens, keys.nodes, keys.children, keys.path]
            + [keys.responses, keys.index, keys.counters],
            args=args,
        )
        return _outcome(reply)

    async def forget(self, index: str, counters: str, summaries: dict[str, str]) -> None:
        """Drop each session whose summary key (``summaries``: id -> key) is gone from
        the tenant's ``index`` and its bytes from ``counters``, in one step."""
        if summaries:
            await self._forget(keys=[index, counters, *summaries.values()], args=list(summaries))

    async def apply(
        self,
        keys: SessionKeys,
        write: TreeWrite,
        *,
        session_id: str,
        write_id: str,
        lock_token: str,
        read_fingerprint: str,
        score: float,
        ttl_ms: int | None,
    ) -> Outcome:
        """Apply one write under the checks in the module docstring; the outcome."""
        args = [
            write_id,
            lock_token,
            read_fingerprint,
            session_id,
            repr(score),
            "" if ttl_ms is None else ttl_ms,
            b"" if write.summary is None else write.summary,
            "0" if write.tokens is None else "1",
            b"" if write.tokens is None else write.tokens,
            -1 if write.path_keep is None else write.path_keep,
            *self.quotas.args(),
            *_counted(write.path_tail),
            *_counted_pairs(write.node_sets),
            *_counted(write.node_dels),
            *_counted_pairs(write.child_sets),
            *_counted(write.child_dels),
            *_counted_pairs(write.response_sets),
            *_counted(write.response_dels),
        ]
        reply = await self._apply(keys=list(keys), args=args)
        return _outcome(reply)


OUTCOMES = frozenset(Outcome.__args__)


def _outcome(reply: bytes | str) -> Outcome:
    outcome = reply.decode() if isinstance(reply, bytes) else reply
    if outcome not in OUTCOMES:
        raise RuntimeError(f"unexpected reply from a commit script: {reply!r}")
    return outcome
