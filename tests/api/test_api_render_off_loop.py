"""Template rendering and tokenization run in a worker thread, never on the event loop,
and a request may not carry more messages than the server renders."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.api.conftest import keyspace, new_session, unique

# Generous safety nets: a test that fails must not leave the server blocked for good.
WAIT_S = 120


@pytest.fixture
def template_calls(api, monkeypatch):
    """Every call of the chat template on the live server, in order."""
    tokenizer = api.services.engine.chat_format.tokenizer
    original = tokenizer.apply_chat_template
    calls: list[threading.Thread] = []

    def apply(*args, **kwargs):
        calls.append(threading.current_thread())
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", apply)
    return calls


@pytest.fixture
def blocked_template(api, monkeypatch):
    """The chat template waits for ``release`` once it is entered (``entered`` is set)."""
    tokenizer = api.services.engine.chat_format.tokenizer
    original = tokenizer.apply_chat_template
    entered, release = threading.Event(), threading.Event()

    def apply(*args, **kwargs):
        entered.set()
        release.wait(WAIT_S)
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", apply)
    try:
        yield entered, release
    finally:
        release.set()


def _chat_completion(api, acme, _session):
    body = {
        "model": api.services.engine.model_name,
        "messages": [{"role": "user", "content": unique("Hi")}],
        "max_tokens": 2,
    }
    return acme.post("/v1/chat/completions", json=body)


def _session_turn(api, acme, session):
    body = {"content": unique("Hi"), "max_tokens": 2}
    return acme.post(f"/sessions/{session['id']}/messages", json=body)


def _inline_system_prompt(api, acme, _session):
    return acme.post("/sessions", json={"system_prompt": unique("Be brief.")})


def _registered_system_prompt(api, acme, _session):
    return acme.post("/system-prompts", json={"name": "brief", "text": unique("Be brief.")})


@pytest.mark.parametrize(
    "send",
    [_chat_completion, _session_turn, _inline_system_prompt, _registered_system_prompt],
    ids=["chat_completion", "session_turn", "inline_system_prompt", "registered_system_prompt"],
)
def test_a_request_rendering_its_template_does_not_hold_up_another(api, acme, send, request):
    session = new_session(acme)  # before the template blocks
    entered, release = request.getfixturevalue("blocked_template")
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(send, api, acme, session)
        try:
            assert entered.wait(WAIT_S), "the request never reached the chat template"
            # The event loop still serves while that request's template is stuck.
            health = httpx.get(f"{api.url}/healthz", timeout=WAIT_S / 4)
            assert health.status_code == 200
            assert not pending.done()
        finally:
            release.set()
        response = pending.result(timeout=WAIT_S)
    assert response.status_code in (200, 201), response.text


def test_too_many_messages_are_refused_before_any_rendering(api, acme, raw_redis, template_calls):
    limit = api.services.settings.limits.max_messages
    before = keyspace(raw_redis, api.services.settings.key_prefix)

    def post(count: int) -> httpx.Response:
        body = {
            "model": api.services.engine.model_name,
            "messages": [{"role": "user", "content": ""}] * count,
            "max_tokens": 1,
        }
        return acme.post("/v1/chat/completions", json=body)

    response = post(limit + 1)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert f"{limit + 1} messages" in error["message"] and str(limit) in error["message"]
    assert template_calls == []
    # At the limit the request is rendered (and here it is too long for the context).
    at_limit = post(limit)
    assert at_limit.json()["error"]["type"] == "context_length_exceeded"
    assert template_calls and api.thread not in template_calls  # not the event loop's thread
    assert keyspace(raw_redis, api.services.settings.key_prefix) == before


def test_the_message_cap_is_a_setting():
    from chatsvc.config import Settings, SettingsError

    assert Settings.from_env({}).limits.max_messages == 1024
    assert Settings.from_env({"CHATSVC_MAX_MESSAGES": "8"}).limits.max_messages == 8
    with pytest.raises(SettingsError, match="max_messages"):
        Settings.from_env({"CHATSVC_MAX_MESSAGES": "0"})
