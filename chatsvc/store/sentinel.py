"""Redis/Valkey behind Sentinel: the ``redis+sentinel://`` URL and the client it builds.

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/<primary name>[/<db>]
                     [?wait_replicas=1&wait_timeout_ms=500&sentinel_password=...]

The hosts are Sentinels (port 26379 when omitted); the userinfo authenticates to
the primary and its replicas, ``sentinel_password`` (and ``sentinel_username``)
to the Sentinels. The client asks the Sentinels for the current primary before
each new connection, so after a failover the pooled connections to the old
primary fail once (a 503 for the requests that used them) and the next ones go
to the promoted replica; no restart is needed.

Asynchronous replication alone can lose a write the primary had already
answered: the primary dies before the replica received it and the replica is
promoted without it. So every Lua script (a stored turn, a new session, a lock
release) and every MULTI/EXEC that writes is followed by
``WAIT wait_replicas wait_timeout_ms`` on the same connection and counts as
done only once that many replicas hold it; a transaction that only reads skips
the wait (a read must not fail because a replica is down). When
fewer confirm in time, the store raises ``UnconfirmedWriteError`` (a
``StoreUnavailableError``, so the API answers 503): the write may exist on the
primary, but it was never acknowledged, and the API says so (it may be stored:
read it back before sending it again). A resend of the same write (same write
or turn id, as redis-py's retry after a lost reply) is applied once; a client's
new request is a new write, so it is the answer that must not claim "not
stored". ``wait_replicas=0`` turns the wait off (faster, and writes go on while
every replica is down, at the price of the loss window above).
"""

from __future__ import annotations

import hashlib
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aredis
import redis.exceptions as rexc
from redis.asyncio.client import Pipeline
from redis.asyncio.sentinel import Sentinel

from chatsvc.store.errors import UnconfirmedWriteError

SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_WAIT_REPLICAS = 1
DEFAULT_WAIT_TIMEOUT_MS = 500


@dataclass(frozen=True)
class SentinelUrl:
    """The parts of a ``redis+sentinel://`` URL (see the module docstring)."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    # repr=False: the URL's secrets must not reach a log line.
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    wait_replicas: int = DEFAULT_WAIT_REPLICAS
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS


def is_sentinel_url(url: str) -> bool:
    """True for a ``redis+sentinel://`` URL (any letter case in the scheme)."""
    return isinstance(url, str) and url.lower().startswith(SCHEME + "://")


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Split a ``redis+sentinel://`` URL; ValueError names the first thing that is wrong."""
    if not is_sentinel_url(url):
        raise ValueError(f"not a {SCHEME}:// url")
    rest = url[len(SCHEME) + 3 :]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        hosts, userinfo = netloc, ""
    username, password = _userinfo(userinfo)
    sentinels = tuple(_host_port(item) for item in hosts.split(",") if item.strip())
    if not sentinels:
        raise ValueError(f"{SCHEME} url names no sentinel host")
    parts = [urllib.parse.unquote(p) for p in path.split("/") if p]
    if not parts:
        raise ValueError(f"{SCHEME} url needs the primary's name: {SCHEME}://host:port/<name>")
    if len(parts) > 2:
        raise ValueError(f"{SCHEME} url path is /<name>[/<db>], got /{path}")
    db = _int("db", parts[1], 0, 1 << 16) if len(parts) == 2 else 0
    options = _options(query)
    return SentinelUrl(
        sentinels=sentinels,
        service_name=parts[0],
        db=db,
        username=username,
        password=password,
        sentinel_username=options.get("sentinel_username"),
        sentinel_password=options.get("sentinel_password"),
        wait_replicas=_int(
            "wait_replicas", options.get("wait_replicas"), 0, 64, DEFAULT_WAIT_REPLICAS
        ),
        wait_timeout_ms=_int(
            "wait_timeout_ms", options.get("wait_timeout_ms"), 1, 60_000, DEFAULT_WAIT_TIMEOUT_MS
        ),
    )


_KNOWN_OPTIONS = ("wait_replicas", "wait_timeout_ms", "sentinel_username", "sentinel_password")


def _options(query: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if name not in _KNOWN_OPTIONS:
            raise ValueError(
                f"unknown {SCHEME} url option {name!r}; known: {', '.join(_KNOWN_OPTIONS)}"
            )
        options[name] = value
    return options


def _userinfo(userinfo: str) -> tuple[str | None, str | None]:
    if not userinfo:
        return None, None
    user, sep, password = userinfo.partition(":")
    user = urllib.parse.unquote(user) or None
    return user, (urllib.parse.unquote(password) if sep else None)


def _host_port(item: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [v6 address]:port
        host, _, tail = item[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else None
    else:
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, None
    if not host:
        raise ValueError(f"sentinel address {item!r} has no host")
    return host, _int("sentinel port", port, 1, 65535, DEFAULT_SENTINEL_PORT)


def _int(name: str, raw: str | None, low: int, high: int, default: int | None = None) -> int:
    if raw is None:
        assert default is not None
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {low}..{high}, got {value}")
    return value


# -- the client ---------------------------------------------------------------


async def confirm_replicated(connection: Any, replicas: int, timeout_ms: int) -> None:
    """``WAIT`` on ``connection`` for its writes so far; raise unless ``replicas`` hold them.

    WAIT counts the replicas that acknowledged everything this connection wrote,
    which is why it must run on the connection of the write itself.
    """
    try:
        await connection.send_command("WAIT", replicas, timeout_ms)
        confirmed = int(await connection.read_response())
    except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
        # Not retried: the write before it may have committed, and a
        # retry of the whole pipeline would apply it twice.
        raise UnconfirmedWriteError(
            f"lost the primary while waiting for {replicas} replica(s) to confirm a write; "
            f"it was not acknowledged: {type(exc).__name__}: {exc}"
        ) from exc
    if confirmed < replicas:
        raise UnconfirmedWriteError(
            f"only {confirmed} of {replicas} replica(s) confirmed a write within "
            f"{timeout_ms} ms; it was not acknowledged (it may still be on the primary)"
        )


# Commands that change nothing: a transaction of these alone (a consistent
# read of a session and its messages) has nothing to wait for. Anything not
# listed counts as a write.
READ_ONLY_COMMANDS = frozenset(
    {
        "GET", "MGET", "EXISTS", "TTL", "PTTL", "TYPE", "STRLEN",
        "LRANGE", "LLEN", "LINDEX",
        "SMEMBERS", "SISMEMBER", "SCARD", "SUNION", "SINTER",
        "ZRANGE", "ZRANGEBYSCORE", "ZREVRANGE", "ZREVRANGEBYSCORE", "ZSCORE", "ZCARD", "ZCOUNT",
        "HGET", "HMGET", "HGETALL", "HEXISTS", "HLEN",
    }
)  # fmt: skip


def writes_anything(commands) -> bool:
    """True if a pipeline's command stack holds a command that is not a known read."""
    for args, _options in commands:
        name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
        if name.upper() not in READ_ONLY_COMMANDS:
            return True
    return False


class ReplicatedPipeline(Pipeline):
    """A pipeline whose transactions with a write return only once enough replicas hold them."""

    wait_replicas = 0
    wait_timeout_ms = DEFAULT_WAIT_TIMEOUT_MS

    async def _execute_transaction(self, connection, commands, raise_on_error):
        # redis-py's hook for one MULTI/EXEC round trip on a held connection; a
        # WatchError or a command error leaves before the wait, as nothing was applied.
        response = await super()._execute_transaction(connection, commands, raise_on_error)
        if self.wait_replicas and writes_anything(commands):
            await confirm_replicated(connection, self.wait_replicas, self.wait_timeout_ms)
        return response


# A Lua script is one atomic step that may write (the store's commits, session
# creates and lock releases are scripts), so it is confirmed like a transaction,
# unless the store declared it a read (``declare_read_only``).
SCRIPT_COMMANDS = frozenset({"EVAL", "EVALSHA"})
_READ_ONLY_SHAS: set[str] = set()


def declare_read_only(script: str) -> str:
    """Mark a Lua script that writes nothing: its calls skip the WAIT (a read of a
    branch must go on while no replica is attached). Returns the script unchanged."""
    _READ_ONLY_SHAS.add(hashlib.sha1(script.encode()).hexdigest())
    return script


def _is_read_only_script(command_name: str, args: tuple) -> bool:
    # ``args`` as redis-py sends them: the command's name, then the script or its sha.
    if len(args) < 2:
        return False
    first = args[1].decode() if isinstance(args[1], bytes) else str(args[1])
    sha = first if command_name == "EVALSHA" else hashlib.sha1(first.encode()).hexdigest()
    return sha.lower() in _READ_ONLY_SHAS


class SentinelRedis(aredis.Redis):
    """The primary's client: transactions and scripts wait for replicas; ``aclose``
    closes the Sentinels."""

    wait_replicas = 0
    wait_timeout_ms = DEFAULT_WAIT_TIMEOUT_MS
    sentinel: Sentinel | None = None

    async def _send_command_parse_response(self, conn, command_name, *args, **options):
        # redis-py's hook for one command's round trip on a held connection: the
        # WAIT must follow on that same connection. A script error (NOSCRIPT
        # included) raises before the wait, as a failed script applied nothing.
        reply = await super()._send_command_parse_response(conn, command_name, *args, **options)
        name = str(command_name).upper()
        if self.wait_replicas and name in SCRIPT_COMMANDS and not _is_read_only_script(name, args):
            await confirm_replicated(conn, self.wait_replicas, self.wait_timeout_ms)
        return reply

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        pipe = ReplicatedPipeline(
            self.connection_pool, self.response_callbacks, transaction, shard_hint
        )
        pipe.wait_replicas = self.wait_replicas
        pipe.wait_timeout_ms = self.wait_timeout_ms
        return pipe

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            if self.sentinel is not None:
                sentinel, self.sentinel = self.sentinel, None
                await sentinel.aclose()


def sentinel_client(url: str, **connection: Any) -> SentinelRedis:
    """A client of the primary that the Sentinels of ``url`` name, with ``connection`` options.

    ``connection`` holds the options of every connection (timeouts, retry,
    client name); the Sentinels get the same timeouts. Raises ValueError for a
    malformed URL, and when ``wait_timeout_ms`` is not below the socket timeout
    (a WAIT that outlives the socket would read as a dead primary).
    """
    spec = parse_sentinel_url(url)
    socket_timeout = connection.get("socket_timeout")
    if spec.wait_replicas and socket_timeout is not None:
        if spec.wait_timeout_ms >= socket_timeout * 1000:
            raise ValueError(
                f"wait_timeout_ms ({spec.wait_timeout_ms}) must be below the socket timeout "
                f"({socket_timeout * 1000:.0f} ms)"
            )
    sentinel_options = {k: v for k, v in connection.items() if k.startswith("socket_")}
    if spec.sentinel_password is not None:
        sentinel_options["password"] = spec.sentinel_password
    if spec.sentinel_username is not None:
        sentinel_options["username"] = spec.sentinel_username
    sentinel = Sentinel(list(spec.sentinels), sentinel_kwargs=sentinel_options)
    client = sentinel.master_for(
        spec.service_name,
        redis_class=SentinelRedis,
        db=spec.db,
        username=spec.username,
        password=spec.password,
        **connection,
    )
    client.sentinel = sentinel
    client.wait_replicas = spec.wait_replicas
    client.wait_timeout_ms = spec.wait_timeout_ms
    return client
