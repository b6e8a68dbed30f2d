"""How many bytes a request's reads of a session returned, for whoever charges for them.

A branch read grows with what the session holds: every message record on the
branch crosses from Redis (which serves nobody else meanwhile) to the replica and
is decoded there. Every other read is bounded (pages end at
1 MiB, summaries and child lists by the message cap). The API charges those bytes
to the tenant's request rate (``chatsvc/api/shared/request_rate.py``), so a
tenant whose sessions are large sends fewer requests, not more expensive ones.
The store only counts, into the meter the caller opened; outside one nothing is
counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class ReadMeter:
    """Bytes counted so far. Shared by reference: a worker thread the request runs
    code in (a copy of its context) counts into the same meter."""

    bytes_read: int = 0


_METER: ContextVar[ReadMeter | None] = ContextVar("chatsvc_store_read_meter", default=None)


@contextmanager
def metered() -> Iterator[ReadMeter]:
    """A meter for the reads made inside the block (and the tasks it starts)."""
    meter = ReadMeter()
    token = _METER.set(meter)
    try:
        yield meter
    finally:
        _METER.reset(token)


def count(num_bytes: int) -> None:
    """Add ``num_bytes`` to the open meter, if any."""
    meter = _METER.get()
    if meter is not None:
        meter.bytes_read += num_bytes
