"""Through HTTP: one tenant's request cannot cut another's stream, and engine errors
mean what they say (400 only for bad input, 500 with no internals, 503 for aborts).

Ordering is made certain, never timed: a wrapper over the live engine's ``step``
holds the engine between steps until the request the test waits for has arrived
(commands are still applied between the held calls).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from bench.live_server import ThreadServer
from chatsvc.api.shared.generation import ENGINE_FAILED
from chatsvc.chat_client import iter_sse
from chatsvc.config import Settings
from tests import http_helpers
from tests.api.conftest import (
    ACME_KEY,
    GLOBEX_KEY,
    TEST_LIMITS,
    engine_config,
    new_session,
    unique,
)
from tests.redis_server import unique_prefix

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp32_api(redis_server):
    """A live server on the fp32 model: in bf16 a greedy answer may take another turn
    when its batch (or its cached prefix) changes, which would hide what is tested."""
    from chatsvc.api.app import create_app

    settings = Settings(
        redis_url=redis_server.url,
        key_prefix=unique_prefix("fp32"),
        api_keys=(("acme", ACME_KEY), ("globex", GLOBEX_KEY)),
        limits=TEST_LIMITS,
        engine=replace(engine_config(), dtype="fp32"),
    )
    with ThreadServer(create_app(settings)) as server:
        yield server


def hold_steps(monkeypatch, core, hold) -> None:
    """While ``hold(core)`` (called on the engine thread) is true, steps do nothing."""
    real_step = core.step

    def step():
        if hold(core):
            time.sleep(0.01)
            return []
        return real_step()

    monkeypatch.setattr(core, "step", step)


def stream_turn(http, session_id: str, text: str, on_first_delta=None) -> list[tuple[str, dict]]:
    body = {"content": text, "stream": True, "temperature": 0, "max_tokens": 24}
    with http.stream("POST", f"/sessions/{session_id}/messages", json=body) as response:
        assert response.status_code == 200
        events = []
        for event, data in iter_sse(response.iter_lines()):
            events.append((event, json.loads(data)))
            if len(events) == 1 and on_first_delta is not None:
                on_first_delta()
    return events


def streamed_text(events) -> str:
    return "".join(data["text"] for event, data in events if event == "delta")


def test_a_tiny_temperature_completion_cannot_cut_another_tenants_stream(fp32_api, monkeypatch):
    with (
        http_helpers.client(fp32_api.url, ACME_KEY, timeout_s=300) as acme,
        http_helpers.client(fp32_api.url, GLOBEX_KEY, timeout_s=300) as globex,
    ):
        _tiny_temperature_beside_a_stream(fp32_api, acme, globex, monkeypatch)


def _tiny_temperature_beside_a_stream(api, acme, globex, monkeypatch) -> None:
    model = acme.get("/v1/models").json()["data"][0]["id"]
    system, text = unique("You tell stories."), unique("Tell me about a dragon.")
    # Twice alone: the second run starts from the cached prefix, as the one under
    # test will, so the only difference left is the request beside it.
    for _ in range(2):
        alone = stream_turn(acme, new_session(acme, system_prompt=system)["id"], text)
        assert alone[-1][0] == "done"
    question = [{"role": "user", "content": unique("Name a colour.")}]
    greedy = globex.post(
        "/v1/chat/completions",
        json={"model": model, "messages": question, "temperature": 0, "max_tokens": 8},
    )
    assert greedy.status_code == 200

    joined = threading.Event()  # set on the engine thread once the completion is in

    def hold(core) -> bool:
        # Hold acme's turn once its first text went out, until globex's completion
        # joins it; from then on both run in the same steps.
        if any(rid.startswith("chat-") for rid in core._requests):
            joined.set()
        states = list(core._requests.values())
        return not joined.is_set() and len(states) == 1 and bool(states[0].seqs[0].detokenizer.text)

    hold_steps(monkeypatch, api.services.engine.engine, hold)
    replies = []

    def send_poison() -> None:
        body = {"model": model, "messages": question, "temperature": 1e-40, "max_tokens": 8}
        replies.append(globex.post("/v1/chat/completions", json=body))

    session = new_session(acme, system_prompt=system)["id"]
    events = stream_turn(acme, session, text, on_first_delta=send_poison)
    assert joined.is_set()
    # The tiny temperature is answered (greedily), and nobody else noticed it.
    (poison,) = replies
    assert poison.status_code == 200, poison.text
    assert (
        poison.json()["choices"][0]["message"]["content"]
        == (greedy.json()["choices"][0]["message"]["content"])
    )
    assert events[-1][0] == "done", events[-1]
    assert streamed_text(events) == streamed_text(alone)
    history = acme.get(f"/sessions/{session}/messages").json()["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant"]
    assert history[-1]["content"] == streamed_text(alone)


def test_an_engine_failure_is_a_500_that_shows_no_internals(api, acme, monkeypatch):
    secret = f"kernel-detail-{uuid.uuid4().hex}"
    core = api.services.engine.engine
    model = acme.get("/v1/models").json()["data"][0]["id"]
    session = new_session(acme)["id"]

    def refuse(batch, kv_pool):
        # A ValueError raised inside a step: the engine's own failure, not bad input.
        raise ValueError(f"the kernel refuses these shapes: {secret}")

    monkeypatch.setattr(core.model, "forward", refuse)
    messages = [{"role": "user", "content": unique("Hi")}]
    answers = [
        acme.post("/v1/chat/completions", json={"model": model, "messages": messages}),
        acme.post(f"/sessions/{session}/messages", json={"content": unique("Hi")}),
    ]
    for answer in answers:
        assert answer.status_code == 500, answer.text
        assert answer.json() == {"error": {"type": "server_error", "message": ENGINE_FAILED}}
        assert secret not in answer.text
    with acme.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": model, "messages": messages, "stream": True},
    ) as response:
        body = "".join(response.iter_lines())
    assert '"server_error"' in body and secret not in body
    monkeypatch.undo()
    # The failed turn stored nothing and released its lock: the next one just works.
    assert acme.get(f"/sessions/{session}/messages").json()["messages"] == []
    reply = acme.post(f"/sessions/{session}/messages", json={"content": "Hi", "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    assert len(acme.get(f"/sessions/{session}/messages").json()["messages"]) == 2


def test_an_aborted_generation_is_a_503_on_both_paths(api, acme, monkeypatch):
    engine = api.services.engine
    arrived: queue.Queue[str] = queue.Queue()
    seen: set[str] = set()

    def hold(core) -> bool:
        # Nothing runs: every request waits here until the test has aborted it.
        for request_id in core._requests:
            if request_id not in seen:
                seen.add(request_id)
                arrived.put(request_id)
        return bool(core._requests)

    hold_steps(monkeypatch, engine.engine, hold)
    model = acme.get("/v1/models").json()["data"][0]["id"]
    session = new_session(acme)["id"]
    calls = [
        ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}]}),
        (f"/sessions/{session}/messages", {"content": unique("Hi")}),
    ]
    with ThreadPoolExecutor(1) as pool:
        for path, body in calls:
            answer = pool.submit(acme.post, path, json=body)
            api.call(engine.abort(arrived.get(timeout=300)))
            response = answer.result(timeout=300)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["type"] == "service_unavailable"
    assert acme.get(f"/sessions/{session}/messages").json()["messages"] == []
