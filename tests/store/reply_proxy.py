"""A TCP proxy in front of a real Redis that can lose one reply: the fault of a failover.

Clients connect to ``proxy.url``; every connection is forwarded to the real
server. Once armed, the first command whose bytes hold every ``must`` marker
and one of the ``commands`` markers reaches Redis (and is applied), but its
reply never reaches the client: the proxy reads it and cuts the client's
connection instead. That is exactly what a client sees when a primary
applies a write and dies (or the network drops) before answering; redis-py
then reconnects and sends the command again.

A ``-NOSCRIPT`` reply is passed through and the proxy stays armed: it is the
script cache missing, not the write, and redis-py answers it by loading the
script and sending the command again.

``ThreadedProxy`` runs one on its own event loop in a thread, for a service
that runs on another loop (bench/live_server.py's ThreadServer).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from urllib.parse import urlparse


class ReplyDroppingProxy:
    def __init__(self, upstream_url: str) -> None:
        self._upstream = urlparse(upstream_url)
        self._server: asyncio.AbstractServer | None = None
        self._must: tuple[bytes, ...] = ()
        self._commands: tuple[bytes, ...] = ()
        self._armed = False
        self.dropped = 0  # replies lost so far
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def arm(self, *must: bytes, commands: tuple[bytes, ...] = (b"EXEC", b"EVALSHA")) -> None:
        """Lose the reply to the next command holding all of ``must`` and one of ``commands``."""
        self._must, self._commands, self._armed = must, commands, True

    async def start(self) -> ReplyDroppingProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _open_upstream(self):
        if self._upstream.scheme == "unix":
            return await asyncio.open_unix_connection(self._upstream.path)
        return await asyncio.open_connection(self._upstream.hostname, self._upstream.port)

    def _matches(self, sent: bytes) -> bool:
        return (
            self._armed
            and all(m in sent for m in self._must)
            and any(c in sent for c in self._commands)
        )

    async def _serve(self, client_r, client_w) -> None:
        up_r, up_w = await self._open_upstream()
        # What the client sent since its last reply: a whole request by the time
        # Redis answers it (RESP clients wait for the reply before the next request).
        sent = bytearray()

        async def client_to_redis() -> None:
            while data := await client_r.read(65536):
                sent.extend(data)
                up_w.write(data)
                await up_w.drain()

        async def redis_to_client() -> None:
            while data := await up_r.read(65536):
                if self._matches(bytes(sent)) and not data.startswith(b"-NOSCRIPT"):
                    self._armed = False
                    self.dropped += 1
                    client_w.transport.abort()  # the client sees a dead connection
                    return
                sent.clear()
                client_w.write(data)
                await client_w.drain()

        tasks = [asyncio.ensure_future(client_to_redis()), asyncio.ensure_future(redis_to_client())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            for writer in (client_w, up_w):
                writer.transport.abort()


class ThreadedProxy:
    """A ReplyDroppingProxy on its own event loop; ``with ThreadedProxy(url) as proxy``."""

    def __init__(self, upstream_url: str) -> None:
        self.proxy = ReplyDroppingProxy(upstream_url)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> ReplyDroppingProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result(30)
        return self.proxy

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
