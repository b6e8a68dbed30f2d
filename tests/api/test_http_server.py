"""The connection guards of chatsvc.api.http_server: a request's head has a deadline,
and an answer given while the client is still sending reaches it whole, the
half-closed connection bounded in time (the lingering close).

A small app with the service's own body guards and metrics, under the same uvicorn
config as ``python -m chatsvc serve``; no model is needed to test how a connection
ends. A cut (a head too late, a client still sending when the lingering close ends)
is counted; a connection that ends on its own is not.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from litestar import Litestar, Request, get, post
from litestar.datastructures import State

from bench.live_server import ThreadServer, wait_until
from chatsvc.api import http_server
from chatsvc.api.shared.body_limit import body_limit_middleware
from chatsvc.api.shared.body_timeout import body_timeout_middleware
from chatsvc.metrics import Metrics

BODY_DEADLINE_S = 1.0
MAX_BODY_BYTES = 1_000_000


@post("/echo")
async def echo(request: Request) -> dict:
    return await request.json()


@get("/slow")
async def slow() -> str:
    await asyncio.sleep(1.5)  # longer than the head deadline the tests below set
    return "done"


def _app() -> Litestar:
    return Litestar(
        [echo, slow],
        middleware=[
            body_timeout_middleware(BODY_DEADLINE_S),
            body_limit_middleware(MAX_BODY_BYTES),
        ],
        # Where the service's app keeps its metrics (chatsvc.service.Services.metrics).
        state=State({"services": SimpleNamespace(metrics=Metrics())}),
    )


def _cuts(server: ThreadServer) -> dict[str, float]:
    registry = server.app.state.services.metrics.registry
    return {
        reason: registry.get_sample_value("chatsvc_connections_cut_total", {"reason": reason}) or 0
        for reason in ("head_timeout", "linger_limit")
    }


@pytest.fixture
def server():
    with ThreadServer(_app()) as running:
        yield running


def _connections(server: ThreadServer) -> int:
    return len(server.server.server_state.connections)


def _read_answer(sock: socket.socket) -> bytes:
    """One whole answer (its head and its Content-Length of body) off ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def _head(length: int) -> bytes:
    return (
        f"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_a_body_sent_whole_past_the_limit_reads_its_413(server):
    # urllib sends all 32 MiB before it reads: closed at once, the server would have
    # reset the connection with most of them unread (a broken pipe, not the 413).
    request = urllib.request.Request(
        server.url + "/echo",
        data=b"x" * (32 * 1024 * 1024),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 413
    assert info.value.headers["Connection"] == "close"
    info.value.close()
    # The client closed its side after reading: the server's side is gone with it.
    wait_until(lambda: _connections(server) == 0, 10, "the connection to close")


def test_a_body_that_goes_on_after_its_408_is_read_and_dropped(server):
    rest = 256 * 1024
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_head(6 + rest) + b'{"a": ')
        assert select.select([sock], [], [], 10)[0], "no answer after the body deadline"
        time.sleep(0.2)  # the answer is out and the server has closed its side
        # The client goes on sending the body the server gave up on, then reads: a
        # server that closed at once resets the connection under these sends.
        for _ in range(rest // 4096):
            sock.sendall(b"x" * 4096)
            time.sleep(0.001)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"did not arrive" in answer  # the middleware's 408 detail


def test_a_client_that_never_stops_sending_is_cut_off(server, monkeypatch):
    # The idle wait is 20 of the client's sending intervals: only a stall that long on a
    # loaded machine would end it as idle (not a cut) instead of at LINGER_S.
    monkeypatch.setattr(http_server, "LINGER_S", 2.0)
    monkeypatch.setattr(http_server, "LINGER_IDLE_S", 1.0)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_head(MAX_BODY_BYTES * 1000))  # refused on its length alone
        assert select.select([sock], [], [], 10)[0], "no 413"
        started = time.monotonic()
        with pytest.raises(OSError):  # the reset of a socket closed under it
            while time.monotonic() - started < 20:
                sock.sendall(b"x" * 64)  # a byte stream well inside the idle wait
                time.sleep(0.05)
        assert _connections(server) == 0
    assert _cuts(server) == {"head_timeout": 0, "linger_limit": 1}


def test_a_client_that_goes_quiet_is_closed_after_the_idle_wait(server, monkeypatch):
    monkeypatch.setattr(http_server, "LINGER_IDLE_S", 0.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_head(MAX_BODY_BYTES * 1000))
        assert _read_answer(sock).startswith(b"HTTP/1.1 413")
        # Neither reading to the end nor closing: only the idle wait ends it.
        wait_until(lambda: _connections(server) == 0, 10, "the lingering close to end")
    assert _cuts(server) == {"head_timeout": 0, "linger_limit": 0}  # it had stopped sending


def test_a_request_read_whole_keeps_its_connection_alive(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        body = b'{"a": 1}'
        for _ in range(2):  # keep-alive: the second request on the same connection
            sock.sendall(_head(len(body)) + body)
            answer = _read_answer(sock)
            assert answer.startswith(b"HTTP/1.1 201"), answer
            assert answer.endswith(b'{"a":1}')
        assert _connections(server) == 1
    assert _cuts(server) == {"head_timeout": 0, "linger_limit": 0}


def test_a_server_stopping_waits_for_no_lingering_client(monkeypatch):
    # Lingering as long as 60 s: a shutdown that waited for it would take that long.
    monkeypatch.setattr(http_server, "LINGER_S", 60.0)
    monkeypatch.setattr(http_server, "LINGER_IDLE_S", 60.0)
    server = ThreadServer(_app()).__enter__()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(_head(MAX_BODY_BYTES * 1000))
        assert _read_answer(sock).startswith(b"HTTP/1.1 413")
        assert _connections(server) == 1  # half-closed, waiting on the client
        started = time.monotonic()
        server.__exit__(None, None, None)
        assert not server.thread.is_alive()
        assert time.monotonic() - started < 30


def _closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``sock`` (EOF or a reset) within ``within_s``."""
    sock.settimeout(within_s)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _echo_once(port: int) -> None:
    body = b'{"beside": "the trickle"}'
    with socket.create_connection(("127.0.0.1", port), timeout=30) as other:
        other.sendall(_head(len(body)) + body)
        answer = _read_answer(other)
    assert answer.startswith(b"HTTP/1.1 201") and answer.endswith(b'{"beside":"the trickle"}')


def test_a_connection_that_sends_nothing_is_closed_at_the_head_deadline(server, monkeypatch):
    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_S", 0.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        _echo_once(server.port)  # served beside it
        # It had been held until the client went away (uvicorn times only keep-alive).
        assert _closed_by_server(sock, 20)
    wait_until(lambda: _connections(server) == 0, 10, "the connection to close")
    assert _cuts(server) == {"head_timeout": 1, "linger_limit": 0}


def test_a_head_trickled_in_is_cut_at_its_deadline_also_after_an_answer(server, monkeypatch):
    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_S", 1.0)
    head = b"GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: " + b"p" * 400 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        # A first request is answered (its handler outlasts the deadline: the deadline
        # is the head's alone), then the next head comes a byte at a time, each byte
        # well inside uvicorn's keep-alive timeout.
        sock.sendall(head)
        assert _read_answer(sock).endswith(b"done")
        started, cut = time.monotonic(), False
        for sent, byte in enumerate(head):
            if sent == 5:  # beside the trickle, another client is answered as ever
                _echo_once(server.port)
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                cut = True
                break
            if select.select([sock], [], [], 0.05)[0]:
                cut = _closed_by_server(sock, 1)
                break
        assert cut, "the trickled head was never cut off"
        assert time.monotonic() - started < len(head) * 0.05  # before it was all sent
    wait_until(lambda: _connections(server) == 0, 10, "the connection to close")
    assert _cuts(server) == {"head_timeout": 1, "linger_limit": 0}
