"""Keyset pagination over a tenant's session index (a sorted set by updated_at).

Listing order is newest first: score descending, ties by id descending (the
order of ZRANGE ... REV). A cursor names the last entry handed out, so pages
stay correct while sessions are created, updated or expire in between (an
offset would skip or repeat entries then).
"""

from __future__ import annotations

import math

import redis.asyncio as aredis

from chatsvc.store.keys import check_id

MAX_LIST_LIMIT = 1000


def encode_cursor(score: float, session_id: str) -> str:
    """An opaque cursor for the entry (score, session_id)."""
    return f"{score!r}:{session_id}"


def decode_cursor(cursor: str) -> tuple[float, str]:
    """The (score, session_id) a cursor names; ``ValueError`` if malformed."""
    if not isinstance(cursor, str):
        raise ValueError(f"malformed cursor: {cursor!r}")
    score_text, sep, session_id = cursor.rpartition(":")
    try:
        score = float(score_text)
        check_id("session", session_id)
    except ValueError:
        score = math.nan
    if not sep or math.isnan(score) or math.isinf(score):
        raise ValueError(f"malformed cursor: {cursor!r}")
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
