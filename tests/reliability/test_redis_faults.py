"""Redis faults mid-traffic: 503 with a clear JSON error within a bounded time, then recovery.

Two kinds of outage, on the service's own Redis (tests/api/test_api_restart.py
covers a killed Redis for reads; this extends it to turns, streams and a
frozen server):

- **killed** (SIGKILL): connections are refused at once;
- **frozen** (SIGSTOP): the server holds connections open and never answers,
  the case only socket timeouts can bound.

The bound on a failing request is what the store promises: every command
times out after ``socket_timeout`` and is tried three times (two retries),
plus slack for this noisy machine. When the server is back, the same service
object serves again, with no restart; nothing a failed turn touched was
written.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import httpx
import pytest

from bench.live_server import ThreadServer
from chatsvc.chat_client import iter_sse
from chatsvc.config import Settings
from chatsvc.store.embedded import EmbeddedRedis
from tests.redis_server import unique_prefix
from tests.reliability.conftest import RELIABILITY_LIMITS, engine_config

pytestmark = pytest.mark.slow

KEY = "faults-tenant-key-0001"
SLACK_S = 10.0
LONG_ANSWER = "Count from one to two hundred in words, one number per line."


@pytest.fixture(scope="module")
def redis_faulty(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("faulty"), appendfsync="always").start()
    yield server
    with contextlib.suppress(ProcessLookupError, TypeError):
        os.kill(server.pid, signal.SIGCONT)
    server.stop()


@pytest.fixture(scope="module")
def service(redis_faulty):
    from chatsvc.api.app import create_app

    settings = Settings(
        redis_url=redis_faulty.url,
        key_prefix=unique_prefix("faults"),
        api_keys=(("faulty", KEY),),
        limits=RELIABILITY_LIMITS,
        engine=engine_config(),
        # A turn lock orphaned by an outage frees itself after its TTL (the tests wait
        # it out); a held one is extended every third of it, so short is safe here.
        turn_lock_ttl_s=5,
    )
    with ThreadServer(create_app(settings)) as server:
        yield server


@pytest.fixture
def http(service):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=service.url, headers=headers, timeout=300) as client:
        yield client


def failure_bound_s(service, round_trips: int = 1) -> float:
    """``round_trips`` failing store calls of three tries of one socket timeout, plus slack.

    A request fails at its first store call (one round trip). A stream whose
    final append fails makes two: the append, then the release of its turn
    lock, which runs before the error event is sent.
    """
    kwargs = service.services.store.redis.connection_pool.connection_kwargs
    return round_trips * 3 * float(kwargs["socket_timeout"]) + SLACK_S


@contextlib.contextmanager
def outage(redis_faulty: EmbeddedRedis, kind: str):
    """Redis killed or frozen for the block, then back (same port, same AOF)."""
    if kind == "killed":
        redis_faulty.kill()
    else:
        os.kill(redis_faulty.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if kind == "killed":
            redis_faulty.start()
        else:
            os.kill(redis_faulty.pid, signal.SIGCONT)


def turn(http: httpx.Client, sid: str, text: str, **extra) -> httpx.Response:
    body = {"content": text, "max_tokens": 4, "temperature": 0, **extra}
    return http.post(f"/sessions/{sid}/messages", json=body)


def turn_when_free(http: httpx.Client, sid: str, text: str, wait_s: float) -> httpx.Response:
    """A turn, retried while a turn lock orphaned by the outage runs out its TTL."""
    deadline = time.monotonic() + wait_s
    response = turn(http, sid, text)
    while response.status_code == 409 and time.monotonic() < deadline:
        time.sleep(0.5)
        response = turn(http, sid, text)
    return response


def snapshot(http: httpx.Client, sid: str) -> tuple[dict, list]:
    session = http.get(f"/sessions/{sid}")
    messages = http.get(f"/sessions/{sid}/messages")
    assert session.status_code == messages.status_code == 200, (session.text, messages.text)
    return session.json(), messages.json()["messages"]


def assert_store_unavailable(response: httpx.Response, elapsed: float, bound: float) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["type"] == "store_unavailable" and "unavailable" in error["message"]
    assert elapsed < bound, f"a failing request took {elapsed:.1f} s (bound {bound:.0f} s)"


@pytest.mark.parametrize("kind", ["killed", "frozen"])
def test_requests_during_an_outage_get_503_then_the_service_recovers(
    service, redis_faulty, http, kind
):
    sid = http.post("/sessions", json={}).json()["id"]
    assert turn(http, sid, f"Hello ({kind})").status_code == 200
    before = snapshot(http, sid)
    bound = failure_bound_s(service)
    with outage(redis_faulty, kind):
        requests = {
            "turn": lambda: turn(http, sid, "Are you there?"),
            "streamed turn": lambda: turn(http, sid, "Are you there?", stream=True),
            "new session": lambda: http.post("/sessions", json={}),
            "history": lambda: http.get(f"/sessions/{sid}/messages"),
        }
        for label, send in requests.items():
            started = time.monotonic()
            response = send()
            elapsed = time.monotonic() - started
            print(f"{kind} redis, {label}: {response.status_code} in {elapsed:.2f} s")
            assert_store_unavailable(response, elapsed, bound)
        ready = http.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["store"] != "ok"
    # Back without a restart of the service: reads, the same session, a new one.
    assert http.get("/readyz").status_code == 200
    assert snapshot(http, sid) == before
    after = turn_when_free(http, sid, "Still here?", wait_s=60)
    assert after.status_code == 200, after.text
    assert len(snapshot(http, sid)[1]) == len(before[1]) + 2
    assert http.post("/sessions", json={}).status_code == 201


def read_stream_with_outage(http, sid, redis_faulty, kind) -> list[tuple[str, dict, float]]:
    """Stream a long answer; take Redis down at the first delta.

    Returns every event as (name, data, arrival time on the monotonic clock).
    """
    events = []
    body = {"content": LONG_ANSWER, "max_tokens": 32, "temperature": 0, "stream": True}
    with contextlib.ExitStack() as stack:
        with http.stream("POST", f"/sessions/{sid}/messages", json=body) as response:
            assert response.status_code == 200
            for event, data in iter_sse(response.iter_lines()):
                events.append((event, json.loads(data), time.monotonic()))
                if len(events) == 1 and event == "delta":
                    stack.enter_context(outage(redis_faulty, kind))
    return events


@pytest.mark.parametrize("kind", ["killed", "frozen"])
def test_a_stream_whose_final_append_fails_ends_with_an_error_event(
    service, redis_faulty, http, kind
):
    sid = http.post("/sessions", json={}).json()["id"]
    before = snapshot(http, sid)
    bound = failure_bound_s(service, round_trips=2)
    events = read_stream_with_outage(http, sid, redis_faulty, kind)
    names = [name for name, _, _ in events]
    assert names.count("delta") >= 2  # Redis went down while the answer was still being generated
    assert "done" not in names
    assert names[-1] == "error" and set(names[:-1]) == {"delta"}
    error = events[-1][1]["error"]
    assert error["type"] == "store_unavailable" and "not stored" in error["message"]
    # From the last token to the error event: bounded by the store's timeouts.
    elapsed = events[-1][2] - events[-2][2]
    print(f"{kind} redis mid-stream: error event {elapsed:.2f} s after the last delta")
    assert elapsed < bound
    # Nothing half-written: the session is exactly as before the turn, and continues.
    assert snapshot(http, sid) == before
    after = turn_when_free(http, sid, "Just say hi.", wait_s=60)
    assert after.status_code == 200, after.text
    assert len(snapshot(http, sid)[1]) == len(before[1]) + 2
