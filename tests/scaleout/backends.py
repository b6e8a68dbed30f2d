"""Small HTTP backends that stand in for replicas where only nginx's behaviour is tested.

Each answers with its own name and records what it received, so a test sees
where nginx sent every request. A few paths misbehave on purpose:

- ``/stream``: one chunk, then waits for ``release`` before the second (tests
  that nginx passes chunks through unbuffered);
- ``/die``: reads the request and closes the connection without answering, as
  a replica killed mid-request does; ``/die-once...``: only the first time that
  method and path arrive anywhere, then answers like any other path;
- ``/stream-die``: one chunk, then closes the connection mid-body.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Hit:
    backend: str
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class Recorder:
    hits: list[Hit] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, hit: Hit) -> None:
        with self.lock:
            self.hits.append(hit)

    def where(self, method: str, path: str) -> list[str]:
        with self.lock:
            return [h.backend for h in self.hits if h.method == method and h.path == path]


class Backend:
    """A threaded HTTP/1.1 server on 127.0.0.1 named ``name``; ``stop()`` closes it."""

    def __init__(self, name: str, recorder: Recorder) -> None:
        self.name = name
        self.recorder = recorder
        self.release = threading.Event()  # lets /stream send its second chunk
        backend = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                seen = backend.recorder.where(self.command, self.path)
                backend.recorder.add(Hit(backend.name, self.command, self.path, dict(self.headers)))
                if self.path == "/die" or (self.path.startswith("/die-once") and not seen):
                    self.close_connection = True
                    return
                if self.path in ("/stream", "/stream-die"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self._chunk(b"data: first\n\n")
                    if self.path == "/stream-die":
                        self.close_connection = True
                        return
                    backend.release.wait(60)
                    self._chunk(b"data: second\n\n")
                    self.wfile.write(b"0\r\n\r\n")
                    return
                body = backend.name.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            do_GET = do_POST = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.address = f"127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
