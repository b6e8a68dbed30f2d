"""Redis client construction and the mapping of transport failures to StoreUnavailableError.

Every store call runs with socket timeouts, so a dead or frozen Redis turns
into a clear ``StoreUnavailableError`` within about ``socket_timeout_s`` (times
the few retries) instead of a request that hangs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis.asyncio as aredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from chatsvc.store.errors import StoreUnavailableError
from chatsvc.store.sentinel import is_sentinel_url, sentinel_client

# Failures that mean "the server is not there or not answering", as opposed to
# a command error (wrong type, script error) that is a bug and should surface.
_TRANSPORT_ERRORS = (rexc.ConnectionError, rexc.TimeoutError, TimeoutError, OSError)


def make_client(
    url: str, *, socket_timeout_s: float = 2.0, client_name: str | None = None
) -> aredis.Redis:
    """A redis-py asyncio client for ``url`` with bounded timeouts.

    Two quick retries let a pooled connection that died with a restarted server
    reconnect transparently; a server that stays down fails fast.
    """
    if not isinstance(url, str) or not url:
        raise ValueError("redis url must be a non-empty string")
    if socket_timeout_s <= 0:
        raise ValueError(f"socket_timeout_s must be > 0, got {socket_timeout_s}")
    options = dict(
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
        retry_on_error=[rexc.ConnectionError, rexc.TimeoutError],
        health_check_interval=30,
        client_name=client_name,
    )
    if is_sentinel_url(url):  # the primary that Sentinel names (chatsvc/store/sentinel.py)
        return sentinel_client(url, **options)
    return aredis.Redis.from_url(url, **options)


def redacted(url: str) -> str:
    """``url`` without its password, fit for error messages and logs."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


def is_transport_error(exc: BaseException | None) -> bool:
    """True if ``exc`` means the server is unreachable (not a command error)."""
    return isinstance(exc, _TRANSPORT_ERRORS)


@contextlib.contextmanager
def unavailable_on_failure(url: str) -> Iterator[None]:
    """Re-raise transport failures inside the block as ``StoreUnavailableError``."""
    try:
        yield
    except StoreUnavailableError:
        raise
    except _TRANSPORT_ERRORS as exc:
        raise StoreUnavailableError(
            f"redis at {redacted(url)} is unavailable: {type(exc).__name__}: {exc}"
        ) from exc
