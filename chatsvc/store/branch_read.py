"""Reading one branch of a session's tree in one atomic step.

A branch is named by its last message (or is the active one). The read script
returns, at one instant, the session's summary, the branch's message ids and
records (root first), the child list of the top level and of every message on
the branch (so each message's siblings, and the last one's continuations), and
how many leading ids the branch shares with the active path.

    active path:  m1 m2 m3 m4          branch of x:  m1 m2 y x
                        └── y ── x     shared with the active path: 2

The active branch comes with the session's stored token history (the one the
next turn extends); any other branch's history is built from its messages.

Walking up from a message off the active path decodes each record's
``parent_id`` in Lua (cmsgpack), one step per message until the walk meets the
active path, so reading the active branch itself decodes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aredis

from chatsvc.store import read_meter
from chatsvc.store.records import MessageRecord, SessionSummary, decode, decode_tokens
from chatsvc.store.sentinel import declare_read_only
from chatsvc.store.tree import ROOT, branch_tokens, split_children

# KEYS: summary, path, nodes, children, tokens. ARGV: the last message's id ('' = the
# active branch, 'root' = no message). Reply: false (no session) | {summary} (unknown
# message) | {summary, ids, records, child lists ('root' then each id), shared,
# the token history (the active branch only, else false)}.
_READ = """
local summary = redis.call('get', KEYS[1])
if not summary then
    return false
end
local path = redis.call('lrange', KEYS[2], 0, -1)
local ids = {}
local shared = 0
if ARGV[1] == '' then
    ids = path
    shared = #path
elseif ARGV[1] ~= 'root' then
    local on_path = {}
    for i, id in ipairs(path) do
        on_path[id] = i
    end
    local tail = {}
    local limit = redis.call('hlen', KEYS[3])
    local id = ARGV[1]
    while id ~= nil and on_path[id] == nil do
        local raw = redis.call('hget', KEYS[3], id)
        if not raw or #tail > limit then
            return {summary}
        end
        tail[#tail + 1] = id
        id = cmsgpack.unpack(raw)['parent_id']
    end
    if id ~= nil then
        shared = on_path[id]
        for i = 1, shared do
            ids[i] = path[i]
        end
    end
    for i = #tail, 1, -1 do
        ids[#ids + 1] = tail[i]
    end
end
local function hmget_all(key, fields)
    local out = {}
    for start = 1, #fields, 500 do
        local part = redis.call('hmget', key, unpack(fields, start, math.min(start + 499, #fields)))
        for j = 1, #part do
            out[#out + 1] = part[j]
        end
    end
    return out
end
local records = hmget_all(KEYS[3], ids)
local parents = {'root'}
for i = 1, #ids do
    parents[i + 1] = ids[i]
end
local children = hmget_all(KEYS[4], parents)
local tokens = false
if ARGV[1] == '' then
    tokens = redis.call('get', KEYS[5])
end
return {summary, ids, records, children, shared, tokens}
"""


class BranchCorruptError(RuntimeError):
    """A branch names a message the session does not hold (a store bug, never input)."""


@dataclass(frozen=True)
class Branch:
    """One branch of a session, read at one instant.

    ``messages`` run from the top to the branch's last message; ``siblings[i]`` are
    the ids of every child of ``messages[i]``'s parent (itself included, oldest
    first); ``continuations`` the children of the last message; ``shared`` how
    many leading messages the branch has in common with the active path.
    """

    session: SessionSummary
    raw_summary: bytes
    messages: list[MessageRecord]
    siblings: list[list[str]]
    continuations: list[str]
    shared: int
    history: list[int] | None = None  # the stored token history, for the active branch

    @property
    def ids(self) -> list[str]:
        return [m.id for m in self.messages]

    @property
    def leaf_id(self) -> str | None:
        return self.messages[-1].id if self.messages else None

    def tokens(self) -> list[int]:
        """The token history up to the branch's last message: the stored one for the
        active branch, else its messages' (``branch_tokens``); the two agree."""
        return list(self.history) if self.history is not None else branch_tokens(self.messages)


class UnknownMessage(Exception):
    """The session exists but holds no message of that id."""


class BranchReader:
    """The read script, registered on one client."""

    def __init__(self, client: aredis.Redis) -> None:
        self._read = client.register_script(declare_read_only(_READ))

    async def read(
        self, keys: tuple[str, str, str, str, str], tenant_id: str, leaf: str | None
    ) -> Branch | None:
        """The branch ending at ``leaf`` (None: the active one; ``ROOT``: no message).

        None when the session is gone or another tenant's; ``UnknownMessage`` when
        it holds no message ``leaf``.
        """
        reply = await self._read(keys=list(keys), args=["" if leaf is None else leaf])
        if not reply:
            return None
        session = decode(SessionSummary, reply[0])
        if session.tenant_id != tenant_id:
            return None
        if len(reply) == 1:
            raise UnknownMessage(leaf)
        raw_summary, ids, raw_records, raw_children, shared, raw_tokens = reply
        ids = [i.decode() for i in ids]
        if any(r is None for r in raw_records):
            raise BranchCorruptError(f"session {session.id!r} lists a message it does not hold")
        read_meter.count(sum(map(len, raw_records)) + len(raw_tokens or b""))
        messages = [decode(MessageRecord, r) for r in raw_records]
        children = [split_children(c) for c in raw_children]
        return Branch(
            session=session,
            raw_summary=raw_summary,
            messages=messages,
            siblings=children[:-1] if ids else [],
            continuations=children[-1],
            shared=int(shared),
            history=None if leaf is not None else decode_tokens(raw_tokens) if raw_tokens else [],
        )


__all__ = ["ROOT", "Branch", "BranchCorruptError", "BranchReader", "UnknownMessage"]
