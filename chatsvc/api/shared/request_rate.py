"""Requests per second per tenant: a token bucket each, checked before the body is read.

The other limits bound what one request may ask; this one bounds how many a
tenant may send. Requests that generate nothing (tokenize, list pages, items
added to a conversation, deletes) put no work into the engine's steps, so the
step share cannot bound them, yet each costs the event loop and the interpreter
its parsing, its Redis round trips and its answer, which every other tenant's
stream waits behind. Counted per replica, in memory (a fleet's figure is the
setting times its replicas, as for the stream limit).

A request's token covers its first ``BYTES_PER_REQUEST`` of session reads;
each further one costs its tenant one more token once the request is done
(``chatsvc/store/read_meter.py``): a branch read costs Redis time in proportion
to what the session holds, and a write or turn reads the whole branch, so
without it a tenant with large sessions would buy seconds of the Redis every
tenant shares at the price of cheap requests.

The check runs before the body is read and before anything looks up a session.
A request a little over the rate waits for its turn; one further over gets a
429 with ``Retry-After`` (see ``request_rate_middleware``). Only requests that
carry a tenant's key are counted (or, without keys, the local tenant's);
requests with no key or a wrong one go on to their 401, the admin's key and the
probes are never counted.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from litestar.types import ASGIApp, Receive, Scope, Send

from chatsvc.api.shared.errors import RateLimitError
from chatsvc.api.shared.startup_gate import OPEN_PATHS
from chatsvc.store.read_meter import metered

# The longest a request over the rate waits for its token before it runs; past that
# it is refused, and the refusal itself is answered this long after the request.
MAX_QUEUE_S = 1.0
REFUSAL_HOLD_S = 1.0
# Session bytes read per token: a MiB of branch costs Redis and the replica about
# what a cheap request does (docs/reliability.md, "Reads charged by their bytes").
BYTES_PER_REQUEST = 1 << 20


class TokenBuckets:
    """One bucket per key: ``burst`` tokens at most, refilled at ``rate`` a second; a
    request takes one, now or, reserved ahead, when it is due.

    Invariant: -rate * max_wait_s - charged <= a bucket's tokens <= burst, where
    max_wait_s is the longest wait ``reserve`` granted (a reserved token is taken when
    granted) and charged what ``charge`` took since the bucket was last full.
    A key whose bucket has refilled is dropped (it is as if new), so the map holds
    only the keys that sent a request in the last few refills.
    """

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic):
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {rate!r}, {burst!r}")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, as of when)
        self.refused = 0

    def reserve(self, key: str, max_wait_s: float) -> tuple[bool, float]:
        """Take ``key``'s next token if it is due within ``max_wait_s``: (True, the seconds
        until it is due, 0.0 for now); else take nothing: (False, the seconds until a
        reservation would be granted)."""
        now = self.clock()
        tokens = self._tokens(key, now)
        wait_s = max(0.0, (1.0 - tokens) / self.rate)
        if wait_s > max_wait_s:
            self._buckets[key] = (tokens, now)
            self.refused += 1
            return False, wait_s - max_wait_s
        self._buckets[key] = (tokens - 1.0, now)
        self._drop_refilled(now)
        return True, wait_s

    def charge(self, key: str, tokens: float) -> None:
        """Take ``tokens`` more from ``key``'s bucket for work a request turned out to
        cost; it may go below zero, and the key's next requests wait or are refused
        until it has refilled."""
        if tokens > 0:
            now = self.clock()
            self._buckets[key] = (self._tokens(key, now) - tokens, now)

    def _tokens(self, key: str, now: float) -> float:
        if key not in self._buckets:
            return float(self.burst)
        tokens, then = self._buckets[key]
        return min(float(self.burst), tokens + (now - then) * self.rate)

    def _drop_refilled(self, now: float) -> None:
        # Amortised: a sweep only once the map has grown past a few hundred keys.
        if len(self._buckets) < 256:
            return
        full = float(self.burst)
        self._buckets = {k: v for k, v in self._buckets.items() if self._tokens(k, now) < full}


def request_rate_middleware(
    rate: int,
    burst: int,
    tenant_of: Callable[[Scope], str | None],
    observe: Callable[[Scope, str], None],
):
    """A middleware factory: ``tenant_of(scope)`` is the tenant a request acts as (None:
    not a tenant's request); each tenant may start ``rate`` requests a second, in bursts
    of up to ``burst``. ``rate`` 0: no limit. ``observe(scope, outcome)`` hears of each
    request past the rate: "delayed" or "refused".

    A request just over the rate waits for its turn (up to ``MAX_QUEUE_S``) rather
    than being refused: a client a little too fast is slowed, not failed. One
    further over is refused, after ``REFUSAL_HOLD_S``: answered at once, a refusal
    is the cheapest request there is, and a client that ignores ``Retry-After``
    would loop on it as fast as the event loop answers, which is what the limit is
    there to prevent (measured: docs/reliability.md, "Requests per second").
    """
    # One set of buckets for the app: Litestar builds a route's middleware stack once per
    # route handler, so buckets made in ``middleware`` would count each route apart.
    buckets = TokenBuckets(rate, burst) if rate else None

    def middleware(app: ASGIApp) -> ASGIApp:
        if buckets is None:
            return app

        async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
                tenant = tenant_of(scope)
                if tenant is not None:
                    granted, wait_s = buckets.reserve(tenant, MAX_QUEUE_S)
                    if not granted or wait_s > 0:
                        observe(scope, "delayed" if granted else "refused")
                    if not granted:
                        await asyncio.sleep(REFUSAL_HOLD_S)
                        retry_after = max(1, math.ceil(wait_s - REFUSAL_HOLD_S))
                        raise RateLimitError(
                            f"too many requests: this tenant may send {rate} a second "
                            f"(bursts of {burst}) to this replica; retry after "
                            f"{retry_after} s",
                            headers={"Retry-After": str(retry_after)},
                        )
                    if wait_s > 0:
                        await asyncio.sleep(wait_s)
                    with metered() as meter:
                        try:
                            await app(scope, receive, send)
                        finally:
                            past = max(0, meter.bytes_read - BYTES_PER_REQUEST)
                            buckets.charge(tenant, past // BYTES_PER_REQUEST)
                    return
            await app(scope, receive, send)

        return wrapped

    return middleware
