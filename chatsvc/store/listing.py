"""Keyset pagination over a tenant's session index (a sorted set by updated_at).

Listing order is newest first: score descending, ties by id descending (the
order of ZRANGE ... REV). A cursor names the last entry handed out, so pages
stay correct while sessions are created, updated or expire in between (an
offset would skip or repeat entries then).

A page reads session summaries only, never token histories, and is bounded in
bytes as well as in count: it ends early, with a cursor, once the next summary
would take it past its byte budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import redis.asyncio as aredis

from chatsvc.store.errors import InvalidInputError
from chatsvc.store.keys import check_id
from chatsvc.store.records import SessionSummary

MAX_LIST_LIMIT = 1000
# Summaries are read this many at a time, so a page that its byte budget ends
# early has read at most this many summaries it did not hand out.
READ_CHUNK = 32


def encode_cursor(score: float, session_id: str) -> str:
    """An opaque cursor for the entry (score, session_id)."""
    return f"{score!r}:{session_id}"


def decode_cursor(cursor: str) -> tuple[float, str]:
    """The (score, session_id) a cursor names; ``InvalidInputError`` if malformed."""
    if not isinstance(cursor, str):
        raise InvalidInputError(f"malformed cursor: {cursor!r}")
    score_text, sep, session_id = cursor.rpartition(":")
    try:
        score = float(score_text)
        check_id("session", session_id)
    except ValueError:
        score = math.nan
    if not sep or math.isnan(score) or math.isinf(score):
        raise InvalidInputError(f"malformed cursor: {cursor!r}")
    return score, session_id


async def index_after(
    client: aredis.Redis, index: str, score: float, after: str | None, count: int
) -> list[tuple[str, float]]:
    """Up to ``count`` index entries strictly after (score, after) in listing order.

    Entries tied with the cursor's score that come at or before it are fetched
    too and skipped here; ties on a float timestamp are rare, so few are.
    """
    max_score = "+inf" if math.isinf(score) else repr(score)
    ties = 0 if after is None else await client.zcount(index, max_score, max_score)
    rows = await client.zrange(
        index,
        max_score,
        "-inf",
        desc=True,
        byscore=True,
        offset=0,
        num=count + ties,
        withscores=True,
    )
    entries = [(member.decode(), member_score) for member, member_score in rows]
    if after is not None:
        entries = [(m, s) for m, s in entries if s < score or m < after]
    return entries[:count]


async def get_many(client: aredis.Redis, keys: list[str]) -> list[bytes | None]:
    """GET each key, in one round trip."""
    # A pipeline of GETs rather than MGET: the keys live in different cluster
    # slots (one hash tag per session).
    if not keys:
        return []
    async with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.get(key)
        return await pipe.execute()


class Page(NamedTuple):
    summaries: list[SessionSummary]
    next_cursor: str | None  # None: nothing after this page
    expired: list[str]  # index entries met whose session is gone (to prune)


def summary_size(summary: SessionSummary) -> int:
    """Bytes ``summary`` takes as JSON: what a page's byte budget counts.

    The API's view of a summary has the same fields but the tenant id, so it
    is never larger than this.
    """
    return len(msgspec.json.encode(summary))


async def read_page(
    client: aredis.Redis,
    index: str,
    summary_key: Callable[[str], str],
    owned: Callable[[bytes | None], SessionSummary | None],
    *,
    after: tuple[float, str | None],
    limit: int,
    max_bytes: int | None,
) -> Page:
    """The summaries after the entry ``after`` names, up to ``limit`` and ``max_bytes``.

    ``owned`` turns a raw summary into the caller's view (None: gone, or not
    the caller's), ``summary_key`` names a session's summary key.
    """
    score, last = after
    summaries: list[SessionSummary] = []
    expired: list[str] = []
    used = 0
    more = True  # the index may hold entries after (score, last)
    full = False  # the byte budget ended the page
    while len(summaries) < limit and more and not full:
        wanted = limit - len(summaries)
        candidates = await index_after(client, index, score, last, wanted + 1)
        more = len(candidates) > wanted
        batch = candidates[:wanted]
        for start in range(0, len(batch), READ_CHUNK):
            chunk = batch[start : start + READ_CHUNK]
            raws = await get_many(client, [summary_key(sid) for sid, _ in chunk])
            for (sid, sid_score), raw in zip(chunk, raws, strict=True):
                summary = owned(raw)
                if summary is not None:
                    size = summary_size(summary)
                    if max_bytes is not None and summaries and used + size > max_bytes:
                        full = True
                        break
                    summaries.append(summary)
                    used += size
                else:
                    expired.append(sid)
                score, last = sid_score, sid
            if full:
                break
    next_cursor = encode_cursor(score, last) if (more or full) and last is not None else None
    return Page(summaries, next_cursor, expired)
