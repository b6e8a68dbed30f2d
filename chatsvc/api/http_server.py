"""How uvicorn serves the app: one config for every entry point, with two guards on
the connection that uvicorn's own h11 protocol lacks.

**A deadline for a request's head.** uvicorn bounds the wait between requests
(keep-alive) but not a connection that sends nothing after connecting, nor a head
(request line and headers) that trickles in or stops: each held a socket for as
long as the client liked, and enough of them take every file descriptor the
process has, its Redis connections' and KV files' included. A request's head must
now arrive within ``HEAD_TIMEOUT_S`` of the connection (or of the previous
answer), else the connection closes; the body has its own deadline
(``api/shared/body_timeout.py``). nginx's ``client_header_timeout`` does the same.

**A lingering close.** An answer given before the request's body has all arrived
(a 408 when the body misses its deadline, a 413 when it is over the size limit, a
400 for a malformed request) is followed by uvicorn closing the socket while the
client is still sending. A socket closed with unread bytes, or one that receives
bytes after its close, makes the kernel send a reset, and a reset can drop the
answer before the client has read it: the client sees "connection reset" instead
of the status that says what went wrong. As nginx does (``lingering_close``), such
a connection is half-closed instead: the answer is followed by a FIN, what the
client still sends is read and dropped, and the socket closes once the client
closes its side or stops sending for a while. Connections closed between requests
(keep-alive expiry, shutdown) have nothing in flight and close at once, as before.

A connection cut by either guard (no head in time; still sending when the lingering
close's limit ends it) is counted in ``chatsvc_connections_cut_total{reason}``, so an
operator sees slow clients, or a slow-loris, at work.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

# How long a half-closed connection waits for the client to stop sending (nginx's
# lingering_time and lingering_timeout): it closes once nothing has come for
# LINGER_IDLE_S, and at the latest LINGER_S after the answer. A client that sends its
# body whole before reading finishes well within them at any local network's speed;
# one that never stops (a slow-loris) holds a socket, no task, LINGER_S at most.
LINGER_S = 30.0
LINGER_IDLE_S = 5.0

# Seconds a request's head (request line and headers) may take to arrive, counted from
# the connection or from the previous answer: the body's deadline's default.
HEAD_TIMEOUT_S = 30.0

# The client's states in which it may still be sending the request it was answered on.
_STILL_SENDING = (h11.SEND_BODY, h11.ERROR)


class _LingeringTransport:
    """The connection's transport, whose ``close`` lingers while the client still sends."""

    def __init__(
        self,
        transport: asyncio.Transport,
        still_sending: Callable[[], bool],
        on_cut: Callable[[str], None],
    ) -> None:
        self._transport = transport
        self._still_sending = still_sending
        self._on_cut = on_cut
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self.lingering = False
        self.may_linger = True  # until the server stops

    def close(self) -> None:
        if self.lingering:
            return
        transport = self._transport
        if (
            transport.is_closing()
            or not self.may_linger
            or not transport.can_write_eof()
            or not self._still_sending()
        ):
            transport.close()
            return
        self.lingering = True
        self._deadline = asyncio.get_running_loop().time() + LINGER_S
        transport.write_eof()  # the FIN goes after the answer's last byte
        transport.resume_reading()  # uvicorn pauses reading while a body waits unread
        self.heard()

    def heard(self) -> None:
        """Bytes came while lingering: wait LINGER_IDLE_S more, within LINGER_S."""
        self.stop()
        loop = asyncio.get_running_loop()
        left = self._deadline - loop.time()
        if left < LINGER_IDLE_S:  # the client may still be sending when this fires
            self._timer = loop.call_later(max(left, 0.0), self._cut)
        else:
            self._timer = loop.call_later(LINGER_IDLE_S, self._transport.close)

    def _cut(self) -> None:
        self._on_cut("linger_limit")
        self._transport.close()

    def close_now(self) -> None:
        """Close without waiting, lingering or not."""
        self.stop()
        self._transport.close()

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def stop(self) -> None:
        """No close is pending any more (the connection is gone, or the timer is re-armed)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head and a lingering
    close for a connection the client still sends on."""

    def __init__(self, *args: Any, on_cut: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_cut = on_cut

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.closing = _LingeringTransport(
            transport, lambda: self.conn.their_state in _STILL_SENDING, self.on_cut
        )
        self.headed: object = None  # the request whose head arrived last
        self.head_timer: asyncio.TimerHandle | None = None
        super().connection_made(self.closing)  # type: ignore[arg-type]
        self.await_head()

    def await_head(self) -> None:
        """From now, the next request's head has HEAD_TIMEOUT_S to arrive."""
        self.stop_head_timer()
        self.head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self.head_late)

    def stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def head_late(self) -> None:
        self.head_timer = None
        if self.cycle is self.headed:  # still no new request: nobody is waiting on one
            self.on_cut("head_timeout")
            self.closing.close()

    def data_received(self, data: bytes) -> None:
        if self.closing.lingering:
            self.closing.heard()
            return  # the rest of a request already answered: dropped unread
        super().data_received(data)
        self.check_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.closing.is_closing():
            return
        self.await_head()
        self.check_head()  # a pipelined request's head may have been read already

    def check_head(self) -> None:
        # uvicorn starts a cycle for each request whose head h11 has parsed.
        if self.cycle is not None and self.cycle is not self.headed:
            self.headed = self.cycle
            self.stop_head_timer()

    def shutdown(self) -> None:
        # The server is stopping: no close waits for a client from now on.
        self.closing.may_linger = False
        if self.closing.lingering:
            self.closing.close_now()
        else:
            super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing.stop()
        self.stop_head_timer()
        super().connection_lost(exc)


def uvicorn_config(app: Any, host: str, port: int, **options: Any) -> uvicorn.Config:
    """The uvicorn config of ``python -m chatsvc serve`` and of the in-process test servers."""
    protocol = functools.partial(GuardedH11Protocol, on_cut=_cut_counter(app))
    return uvicorn.Config(app, host=host, port=port, http=protocol, **options)


def _cut_counter(app: Any) -> Callable[[str], None]:
    """Counts a guard's cut in the app's metrics, once its services run (a connection cut
    during start-up, or under an app without them, is not counted)."""

    def count(reason: str) -> None:
        services = getattr(getattr(app, "state", None), "services", None)
        if services is not None:
            services.metrics.connections_cut.labels(reason).inc()

    return count
