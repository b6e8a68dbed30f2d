"""Redis client construction and the mapping of transport failures to StoreUnavailableError.

Every store call runs with socket timeouts, so a dead or frozen Redis turns
into a clear ``StoreUnavailableError`` within about ``socket_timeout_s`` (times
the few retries) instead of a request that hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import redis.asyncio as aredis
import redis.exceptions as rexc
from redis.asyncio.connection import UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from chatsvc.store.errors import StoreUnavailableError

# Failures that mean "the server is not there or not answering", as opposed to
# a command error (wrong type, script error) that is a bug and should surface.
_TRANSPORT_ERRORS = (rexc.ConnectionError, rexc.TimeoutError, TimeoutError, OSError)
# Query parameters of a Redis URL that carry a secret.
_SECRET_PARAMS = frozenset({"password", "ssl_password"})


def make_client(
    url: str, *, socket_timeout_s: float = 2.0, client_name: str | None = None
) -> aredis.Redis:
    """A redis-py asyncio client for ``url`` with bounded timeouts.

    Two quick retries let a pooled connection that died with a restarted server
    reconnect transparently; a server that stays down fails fast.

    No connection health checks: redis-py runs its PING check with a retry of
    its own inside the command's retry, and inside every reconnect's handshake,
    so against a frozen server one command could wait through many nested
    rounds of timeouts (without end, on a unix socket) instead of three. A dead
    pooled connection is caught by the command's own retry; every write the
    store may see sent twice is safe to repeat (see commit.py and lock.py).
    """
    if not isinstance(url, str) or not url:
        raise ValueError("redis url must be a non-empty string")
    if socket_timeout_s <= 0:
        raise ValueError(f"socket_timeout_s must be > 0, got {socket_timeout_s}")
    pool = aredis.ConnectionPool.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
        retry_on_error=[rexc.ConnectionError, rexc.TimeoutError],
        health_check_interval=0,
        client_name=client_name,
    )
    if pool.connection_class is UnixDomainSocketConnection:
        pool.connection_class = _UnixConnection
    return aredis.Redis.from_pool(pool)


class _UnixConnection(UnixDomainSocketConnection):
    """A unix-socket connection that connects the way a TCP one does.

    redis-py's own runs the handshake (CLIENT SETINFO, AUTH, SELECT) inside
    ``_connect``, which ``connect`` retries and then follows with the handshake
    again, so against a frozen server each connect cost three handshake
    timeouts where a TCP connect costs one.
    """

    async def _connect(self) -> None:
        self._reader, self._writer = await asyncio.wait_for(
            asyncio.open_unix_connection(path=self.path), self.socket_connect_timeout
        )


def redacted(url: str) -> str:
    """``url`` without its credentials, fit for logs.

    redis-py takes a password in the user-info part (``redis://user:pass@host``,
    ``unix://:pass@/path``) and as a query parameter (``?password=``); both are
    masked, whatever the scheme (redis, rediss, unix). Everything up to the last
    ``@`` counts as user info, so a password holding ``?``, ``/`` or ``@`` is
    masked whole (at worst with more of the URL than needed).
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" in rest:
        rest = "***@" + rest.rpartition("@")[2]
    location, question, query = rest.partition("?")
    if question:
        params = []
        for param in query.split("&"):
            name, equals, _ = param.partition("=")
            secret = equals and name.strip().lower() in _SECRET_PARAMS
            params.append(f"{name}=***" if secret else param)
        location = f"{location}?{'&'.join(params)}"
    return f"{scheme}{sep}{location}"


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
