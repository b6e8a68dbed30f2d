"""One page of a session's active branch, read by position in its path list.

The active path (``p:session:{<sid>}:path``, keys.py) lists the active branch's
message ids root first, so a page is an LRANGE of the ids it covers and one
HMGET of just their records: the rest of the branch is never read, and a page
costs the same at 10 messages as at 10,000.

    path:   m0 m1 m2 m3 m4 m5          asc,  after m1, limit 2 -> m2 m3 (more: yes)
    index:   0  1  2  3  4  5          desc, after m4, limit 3 -> m3 m2 m1 (more: yes)

The cursor is a message id (``after``): the page starts next to it, in the
order asked. LPOS finds it by scanning ids only, inside Redis. The id just
before the page is read too: its children are the first message's siblings.
A page may also be bounded in bytes (``max_bytes``, its records' stored
size): it then ends early, with ``has_more``, but always holds one message
if any is left, so paging advances.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aredis

from chatsvc.store.branch_read import BranchCorruptError
from chatsvc.store.errors import InvalidInputError
from chatsvc.store.records import MessageRecord, SessionSummary, decode
from chatsvc.store.sentinel import declare_read_only
from chatsvc.store.tree import ROOT, split_children

# The most messages one page holds (the API's own bounds sit at or under it).
MAX_PAGE_LIMIT = 1000

Order = Literal["asc", "desc"]

# KEYS: summary, path, nodes, children. ARGV: after ('' = from the start of the
# order), order ('asc' | 'desc'), limit, max bytes ('' = none). Reply: false (no
# session) | {summary} (``after`` is not on the active path) | {summary, ids (path
# order), records, child lists of each id's parent, the last message's child
# list, path length, more (1 | 0)}.
_PAGE = f"""
local summary = redis.call('get', KEYS[1])
if not summary then
    return false
end
local n = redis.call('llen', KEYS[2])
local pos = nil
if ARGV[1] ~= '' then
    pos = redis.call('lpos', KEYS[2], ARGV[1])
    if not pos then
        return {{summary}}
    end
end
local limit = tonumber(ARGV[3])
local first, last, more
if ARGV[2] == 'asc' then
    first = pos and pos + 1 or 0
    last = math.min(first + limit - 1, n - 1)
    more = last < n - 1
else
    last = pos and pos - 1 or n - 1
    first = math.max(last - limit + 1, 0)
    more = first > 0
end
local ids, parents, records, children = {{}}, {{}}, {{}}, {{}}
if first <= last then
    local from = math.max(first - 1, 0)
    local window = redis.call('lrange', KEYS[2], from, last)
    for j = first - from + 1, #window do
        ids[#ids + 1] = window[j]
        parents[#parents + 1] = window[j - 1] or '{ROOT}'
    end
    records = redis.call('hmget', KEYS[3], unpack(ids))
    local budget = tonumber(ARGV[4])
    if budget then
        -- Walk in the order asked; keep what fits, at least one message.
        local keep, used = 0, 0
        for step = 1, #ids do
            local j = step
            if ARGV[2] ~= 'asc' then
                j = #ids - step + 1
            end
            local size = records[j] and #records[j] or 0
            if keep > 0 and used + size > budget then
                break
            end
            keep, used = keep + 1, used + size
        end
        if keep < #ids then
            more = true
            local lo, hi = 1, keep
            if ARGV[2] ~= 'asc' then
                lo, hi = #ids - keep + 1, #ids
            end
            local kept_ids, kept_parents, kept_records = {{}}, {{}}, {{}}
            for j = lo, hi do
                kept_ids[#kept_ids + 1] = ids[j]
                kept_parents[#kept_parents + 1] = parents[j]
                kept_records[#kept_records + 1] = records[j]
            end
            ids, parents, records = kept_ids, kept_parents, kept_records
        end
    end
    children = redis.call('hmget', KEYS[4], unpack(parents))
end
local tail = redis.call('lindex', KEYS[2], -1) or '{ROOT}'
local continuations = redis.call('hget', KEYS[4], tail) or ''
return {{summary, ids, records, children, continuations, n, more and 1 or 0}}
"""


@dataclass(frozen=True)
class PathPage:
    """A page of the active branch, in the order asked.

    ``siblings[i]``: every child of ``messages[i]``'s parent (itself included,
    oldest first); ``continuations``: the children of the branch's last message;
    ``total``: the messages on the active branch; ``has_more``: messages follow
    the page in its order.
    """

    session: SessionSummary
    messages: list[MessageRecord]
    siblings: list[list[str]]
    continuations: list[str]
    total: int
    has_more: bool


class PageReader:
    """The page script, registered on one client."""

    def __init__(self, client: aredis.Redis) -> None:
        self._page = client.register_script(declare_read_only(_PAGE))

    async def read(
        self,
        keys: tuple[str, str, str, str],
        tenant_id: str,
        *,
        limit: int,
        after: str | None,
        order: Order,
        max_bytes: int | None = None,
    ) -> PathPage | None:
        """The page of up to ``limit`` messages next to ``after`` (None: from the start
        of ``order``), ending early past ``max_bytes`` of records (None: no bound);
        None if the session is gone or another tenant's; ``InvalidInputError`` if
        ``after`` is not on the active branch."""
        args = [
            "" if after is None else after,
            order,
            limit,
            "" if max_bytes is None else max_bytes,
        ]
        reply = await self._page(keys=list(keys), args=args)
        if not reply:
            return None
        session = decode(SessionSummary, reply[0])
        if session.tenant_id != tenant_id:
            return None
        if len(reply) == 1:
            raise InvalidInputError(f"after names no message of the active branch: {after!r}")
        _, ids, raw_records, raw_children, raw_continuations, total, more = reply
        if any(r is None for r in raw_records):
            raise BranchCorruptError(f"session {session.id!r} lists a message it does not hold")
        messages = [decode(MessageRecord, r) for r in raw_records]
        siblings = [split_children(c) for c in raw_children]
        if order == "desc":
            messages.reverse()
            siblings.reverse()
        return PathPage(
            session=session,
            messages=messages,
            siblings=siblings,
            continuations=split_children(raw_continuations),
            total=int(total),
            has_more=bool(more),
        )
