"""The service when its engine thread dies or stalls: streams fail at once, /readyz says
so, the process exits non-zero so a supervisor restarts it.

In-process (its own server: the death is for good) for what clients see; as a
child process (``python -m chatsvc serve`` with an injected fault) for the exit.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.live_server import ProcessServer, ThreadServer
from chatsvc.__main__ import EXIT_ENGINE_DIED
from chatsvc.chat_client import iter_sse
from chatsvc.config import Settings
from tests import http_helpers
from tests.api.conftest import ACME_KEY, ADMIN_KEY, TEST_LIMITS, engine_config
from tests.api.engine_death_server import HANG_STOP, KILL_STOP
from tests.http_helpers import new_session, unique
from tests.redis_server import unique_prefix

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def doomed(redis_server):
    """A live server of its own: its engine is killed by the test."""
    from chatsvc.api.app import create_app

    settings = Settings(
        redis_url=redis_server.url,
        key_prefix=unique_prefix("doomed"),
        admin_key=ADMIN_KEY,
        api_keys=(("acme", ACME_KEY),),
        limits=TEST_LIMITS,
        engine=engine_config(),
    )
    with ThreadServer(create_app(settings)) as server:
        yield server


def _stream(http, session_id: str):
    body = {"content": unique("Tell a long story."), "stream": True, "max_tokens": 48}
    return http.stream("POST", f"/sessions/{session_id}/messages", json={**body, "temperature": 0})


def test_a_dead_engine_fails_every_stream_and_turns_the_service_not_ready(doomed, monkeypatch):
    core = doomed.services.engine.engine
    real_step = core.step

    def step():
        # Runs on the engine thread. Holds the first turn (once its first text went
        # out) until a second one joins; once both have tokens, the loop breaks.
        states = list(core._requests.values())
        if len(states) == 2 and all(s.seqs[0].output_token_ids for s in states):
            raise RuntimeError("injected: a bug in the engine loop")
        if len(states) == 1 and states[0].seqs[0].detokenizer.text:
            time.sleep(0.01)  # commands (the second turn's admission) apply between calls
            return []
        return real_step()

    monkeypatch.setattr(core, "step", step)
    with http_helpers.client(doomed.url, ACME_KEY, timeout_s=300) as acme:
        first, second = new_session(acme)["id"], new_session(acme)["id"]
        with _stream(acme, first) as a:
            events_a = iter_sse(a.iter_lines())
            assert next(events_a)[0] == "delta"  # in flight
            with _stream(acme, second) as b:
                events_b = list(iter_sse(b.iter_lines()))
            events_a = list(events_a)
        for events in (events_a, events_b):
            kind, data = events[-1]
            assert kind == "error", events
            assert json.loads(data)["error"]["type"] == "service_unavailable"

        ready = acme.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["engine"] == "died: RuntimeError"
        # The turn locks were released with the failed waiters: a new turn on the same
        # session is refused for the engine (503), not as busy (409), and at once.
        again = acme.post(f"/sessions/{first}/messages", json={"content": "Still there?"})
        assert again.status_code == 503, again.text
        assert again.json()["error"]["type"] == "service_unavailable"
        model = acme.get("/v1/models").json()["data"][0]["id"]
        chat = acme.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "Hi"}]},
        )
        assert chat.status_code == 503
        for sid in (first, second):  # nothing half-written
            assert acme.get(f"/sessions/{sid}/messages").json()["messages"] == []
    with http_helpers.client(doomed.url, ADMIN_KEY) as admin:
        assert admin.get("/metrics").status_code == 200  # a scrape still answers
        cache = admin.get("/admin/cache")  # no cache to report: the same 503, not a 500
        assert cache.status_code == 503, cache.text
        assert cache.json()["error"]["type"] == "service_unavailable"


def _faulty_server(redis_server, log: Path, label: str, **env: str) -> ProcessServer:
    """``python -m tests.api.engine_death_server serve`` (the injected faults) on its own prefix."""
    env = {
        "CHATSVC_REDIS_URL": redis_server.url,
        "CHATSVC_KEY_PREFIX": unique_prefix(label),
        "CHATSVC_API_KEYS": f"acme:{ACME_KEY}",
        "CHATSVC_HOST": "127.0.0.1",
        "CHATSVC_NUM_GPU_BLOCKS": "128",
        "CHATSVC_MAX_MODEL_LEN": "1024",
        "CHATSVC_MAX_TOKENS_CAP": "64",
        **env,
    }
    return ProcessServer(env, log, module="tests.api.engine_death_server")


def test_serve_exits_non_zero_when_the_engine_thread_dies(redis_server, tmp_path):
    server = _faulty_server(redis_server, tmp_path / "chatsvc.log", "death")
    server.start()
    try:
        with http_helpers.client(server.url, ACME_KEY, timeout_s=300) as acme:
            sid = new_session(acme)["id"]
            assert acme.get("/readyz").status_code == 200
            body = {"content": "Hello!", "max_tokens": 8, "stop": [KILL_STOP]}
            killed = acme.post(f"/sessions/{sid}/messages", json=body)
            assert killed.status_code == 503, killed.text
        # A readiness wait, not a speed check: shutdown drains for up to 10 s.
        assert server.process.wait(timeout=120) == EXIT_ENGINE_DIED
        assert "the engine thread died" in (tmp_path / "chatsvc.log").read_text()
    finally:
        server.stop()


def test_serve_exits_when_the_engine_stalls_and_the_session_goes_on_after_the_restart(
    redis_server, tmp_path
):
    log = tmp_path / "chatsvc.log"
    server = _faulty_server(redis_server, log, "stall", CHATSVC_WATCHDOG_TIMEOUT_S="2")
    server.start()
    try:
        with http_helpers.client(server.url, ACME_KEY, timeout_s=300) as acme:
            sid = new_session(acme)["id"]
            body = {"content": "Hello!", "max_tokens": 8, "stop": [HANG_STOP]}
            hung = acme.post(f"/sessions/{sid}/messages", json=body)
            assert hung.status_code == 503, hung.text
            assert hung.json()["error"]["type"] == "service_unavailable"
            assert "no progress" in hung.json()["error"]["message"]
        # The step never returns; the process exits all the same (the thread is not joined).
        assert server.process.wait(timeout=120) == EXIT_ENGINE_DIED
        text = log.read_text()
        assert "the engine made no progress for" in text
        # The stuck thread's stack is in the log, down to the line that waits.
        engine_stack = text.split('Thread "chatsvc-engine":', 1)[1].split("Thread ", 1)[0]
        assert "threading.Event().wait()" in engine_stack
        assert "chatsvc: the engine stalled" in text
        # Its supervisor starts it again: the turn lock went with the failed turn (no 409
        # for the lock's TTL), nothing of the turn was stored, and the session goes on.
        server.module = "chatsvc"
        server.start()
        with http_helpers.client(server.url, ACME_KEY, timeout_s=300) as acme:
            assert acme.get(f"/sessions/{sid}/messages").json()["messages"] == []
            again = acme.post(f"/sessions/{sid}/messages", json={"content": "Hello!"})
            assert again.status_code == 200, again.text
            assert len(acme.get(f"/sessions/{sid}/messages").json()["messages"]) == 2
    finally:
        server.stop()
