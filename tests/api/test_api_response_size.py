"""An OpenAI answer's size: bounded before any work, a prompt's scores built once for
all its choices, and a large answer built off the event loop (response_size.py)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from chatsvc.api.openai import chat_completions, completion_output, response_size
from tests.api.conftest import keyspace
from tests.api.engine_recorder import record_engine

# Token ids any vocabulary holds; each test shifts them so no two share a prompt.
FIRST_ID = 300


def _ids(count: int, shift: int) -> list[int]:
    return [FIRST_ID + shift + i for i in range(count)]


def _over_the_limit(api) -> dict:
    # 2 x 600 token ids, n 4, 21 scores per prompt token: ~10 MB asked by a 7 KB body.
    return {
        "model": api.services.engine.model_name,
        "prompt": [_ids(600, 0), _ids(600, 1)],
        "n": api.services.settings.limits.max_n,
        "prompt_logprobs": 20,
        "max_tokens": 1,
    }


@pytest.fixture
def threads_of(monkeypatch):
    """``threads_of(module, name)``: the threads every later call of module.name ran in."""

    def spy(module, name: str) -> list[threading.Thread]:
        original = getattr(module, name)
        calls: list[threading.Thread] = []

        def recorded(*args, **kwargs):
            calls.append(threading.current_thread())
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)
        return calls

    return spy


@pytest.fixture
def estimates(monkeypatch) -> list[int]:
    """Every answer-size estimate the endpoints check, in order."""
    seen: list[int] = []
    original = response_size.check_response_bytes

    def check(estimate: int, limit: int) -> None:
        seen.append(estimate)
        original(estimate, limit)

    monkeypatch.setattr(response_size, "check_response_bytes", check)
    return seen


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_an_answer_past_the_byte_limit_is_refused_before_any_work(
    api, acme, raw_redis, monkeypatch, stream
):
    limit = api.services.settings.limits.max_response_bytes
    calls = record_engine(monkeypatch, api.services.engine)
    before = keyspace(raw_redis, api.services.settings.key_prefix)
    response = acme.post("/v1/completions", json={**_over_the_limit(api), "stream": stream})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "max_response_bytes" in error["message"] and str(limit) in error["message"]
    assert calls == []
    assert keyspace(raw_redis, api.services.settings.key_prefix) == before


def test_a_chat_answer_past_the_byte_limit_is_refused_before_any_work(api, acme, monkeypatch):
    limits = api.services.settings.limits
    calls = record_engine(monkeypatch, api.services.engine)
    body = {
        "model": api.services.engine.model_name,
        "messages": [{"role": "user", "content": "Count to a hundred."}],
        "n": limits.max_n,
        "max_tokens": limits.max_tokens_cap,
        "logprobs": True,
        "top_logprobs": 20,
    }
    response = acme.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert "max_response_bytes" in response.json()["error"]["message"]
    assert calls == []


def test_a_refused_answer_leaves_the_request_beside_it_unchanged(api, acme, globex):
    good = {
        "model": api.services.engine.model_name,
        "prompt": _ids(24, 2),
        "max_tokens": 2,
        "temperature": 0,
        "prompt_logprobs": 1,
    }
    alone = acme.post("/v1/completions", json=good)
    assert alone.status_code == 200, alone.text
    with ThreadPoolExecutor(max_workers=2) as pool:
        refused = pool.submit(globex.post, "/v1/completions", json=_over_the_limit(api))
        beside = pool.submit(acme.post, "/v1/completions", json=good)
        assert refused.result().status_code == 400
        answer = beside.result()
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"] == alone.json()["choices"]


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_a_prompts_scores_are_built_once_and_shared_by_its_choices(api, acme, threads_of, stream):
    built = threads_of(completion_output, "prompt_logprob_dicts")
    body = {
        "model": api.services.engine.model_name,
        "prompt": _ids(20, 3 + stream),
        "n": 2,
        "max_tokens": 1,
        "prompt_logprobs": 3,
        "stream": stream,
    }
    response = acme.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [line[len("data: ") :] for line in response.text.splitlines() if line]
        choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
        scores = [c["prompt_logprobs"] for c in choices if "prompt_logprobs" in c]
    else:
        scores = [c["prompt_logprobs"] for c in response.json()["choices"]]
    assert len(scores) == 2 and scores[0] == scores[1]
    assert scores[0][0] is None and len(scores[0]) == 20
    assert len(built) == 1


def test_echoed_prompt_logprobs_are_the_same_on_every_choice(api, acme):
    ids = _ids(12, 5)
    body = {
        "model": api.services.engine.model_name,
        "prompt": ids,
        "n": 2,
        "max_tokens": 2,
        "echo": True,
        "logprobs": 1,
    }
    response = acme.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    first, second = (c["logprobs"] for c in response.json()["choices"])
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert first[field][: len(ids)] == second[field][: len(ids)]
        assert len(first[field]) == len(ids) + 2
    # The generated tokens' offsets go on from the echoed prompt's.
    assert first["text_offset"][len(ids)] == sum(len(t) for t in first["tokens"][: len(ids)])


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_a_large_completion_is_built_and_encoded_off_the_event_loop(
    api, acme, threads_of, estimates, stream
):
    built = threads_of(completion_output, "prompt_logprob_dicts")
    encoded = threads_of(response_size, "encode_answer")
    body = {
        "model": api.services.engine.model_name,
        "prompt": _ids(200, 6 + stream),
        "n": 2,
        "max_tokens": 1,
        "prompt_logprobs": 5,
        "stream": stream,
    }
    response = acme.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert estimates[-1] > response_size.OFF_LOOP_BYTES
    assert len(response.content) <= estimates[-1]  # the estimate stays above the answer
    assert built and api.thread not in built  # not the event loop's thread
    assert encoded and api.thread not in encoded[: 1 if stream else None]


def test_a_large_chat_answer_is_built_off_the_event_loop(api, acme, threads_of, estimates):
    built = threads_of(chat_completions, "chat_logprobs")
    body = {
        "model": api.services.engine.model_name,
        "messages": [{"role": "user", "content": "Name some colours."}],
        "n": 4,
        "max_tokens": 16,
        "logprobs": True,
        "top_logprobs": 8,
    }
    response = acme.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert estimates[-1] > response_size.OFF_LOOP_BYTES
    assert len(response.content) <= estimates[-1]
    assert built and api.thread not in built


def test_a_small_answer_is_encoded_on_the_loop(api, acme, threads_of):
    # The thread hop costs more than encoding a small answer.
    encoded = threads_of(response_size, "encode_answer")
    body = {"model": api.services.engine.model_name, "prompt": _ids(4, 8), "max_tokens": 1}
    assert acme.post("/v1/completions", json=body).status_code == 200
    assert encoded == [api.thread]


def test_the_response_byte_limit_is_a_setting():
    from chatsvc.config import Settings, SettingsError

    assert Settings.from_env({}).limits.max_response_bytes == 16 * 1024 * 1024
    env = {"CHATSVC_MAX_RESPONSE_BYTES": "1000"}
    assert Settings.from_env(env).limits.max_response_bytes == 1000
    with pytest.raises(SettingsError, match="max_response_bytes"):
        Settings.from_env({"CHATSVC_MAX_RESPONSE_BYTES": "0"})
