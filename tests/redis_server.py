"""A real Redis-compatible server for the test session, and per-test key prefixes.

Any conftest can use it:

    @pytest.fixture(scope="session")
    def redis_server(tmp_path_factory):
        with started_server(tmp_path_factory.mktemp("redis")) as server:
            yield server

Tests share the server and keep apart by key prefix (``unique_prefix()``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from bench.live_server import unique_prefix
from chatsvc.store.embedded import EmbeddedRedis

__all__ = ["started_server", "unique_prefix"]


@contextlib.contextmanager
def started_server(data_dir: Path, appendfsync: str = "everysec") -> Iterator[EmbeddedRedis]:
    """Start an EmbeddedRedis in ``data_dir`` for the block.

    ``everysec`` by default: the shared test server need not fsync every write;
    the persistence tests start their own server with ``always``.
    """
    server = EmbeddedRedis(data_dir, appendfsync=appendfsync)
    server.start()
    try:
        yield server
    finally:
        server.stop()
