"""Every kind of bad input: a clear 4xx JSON error, and Redis exactly as before."""

from __future__ import annotations

import pytest

from tests.api.conftest import MAX_MODEL_LEN, TEST_LIMITS, keyspace, new_session, unique

UNKNOWN = "f" * 32


@pytest.fixture
def session_id(acme):
    session = new_session(acme, system_prompt=unique("Be brief."))
    return session["id"]


def _cases(session_id: str, model: str):
    messages = f"/sessions/{session_id}/messages"
    chat = "/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    long_text = "lorem ipsum " * (MAX_MODEL_LEN // 2)  # under the char limit, over the context
    assert len(long_text) < TEST_LIMITS.max_message_chars
    return [
        # (method, path, json body or raw bytes, status, error type)
        ("POST", f"/sessions/{UNKNOWN}/messages", {"content": "hi"}, 404, "not_found_error"),
        ("POST", "/sessions/not a valid id/messages", {"content": "hi"}, 404, "not_found_error"),
        ("POST", messages, {"content": "   "}, 400, "invalid_request_error"),
        ("POST", messages, {"content": "x" * (TEST_LIMITS.max_message_chars + 1)}, 400, None),
        ("POST", messages, {"content": long_text}, 400, "context_length_exceeded"),
        ("POST", messages, {"content": "hi", "max_tokens": 8, "temperature": -1}, 400, None),
        ("POST", messages, {"content": "hi", "top_p": 0}, 400, None),
        ("POST", messages, {"content": "hi", "max_tokens": 0}, 400, None),
        ("POST", messages, {"content": "hi", "max_tokens": 10_000}, 400, None),
        ("POST", messages, {"content": "hi", "top_k": -3}, 400, None),
        ("POST", messages, {"content": "hi", "stop": [""]}, 400, None),
        ("POST", messages, {"content": "hi", "bogus": 1}, 400, "invalid_request_error"),
        ("POST", messages, {"content": 5}, 400, "invalid_request_error"),
        ("POST", messages, b'{"content": "hi",', 400, "invalid_request_error"),
        ("POST", messages, b"x" * (TEST_LIMITS.max_body_bytes + 1), 413, "request_too_large"),
        ("POST", "/sessions", {"system_prompt_id": UNKNOWN}, 404, "not_found_error"),
        ("POST", "/sessions", {"system_prompt": "a", "system_prompt_id": UNKNOWN}, 400, None),
        ("POST", "/sessions", {"system_prompt": ""}, 400, None),
        ("POST", "/sessions", {"metadata": {"k": 1}}, 400, None),
        ("POST", "/system-prompts", {"name": "x", "text": " "}, 400, None),
        ("POST", "/system-prompts", {"name": "", "text": "ok"}, 400, None),
        ("GET", "/sessions?limit=0", None, 400, None),
        ("GET", "/sessions?cursor=garbage", None, 400, None),
        ("POST", chat, {"model": "nope", "messages": user}, 404, "model_not_found"),
        ("POST", chat, {"model": model, "messages": []}, 400, None),
        ("POST", chat, {"model": model, "messages": user, "n": 99}, 400, None),
        ("POST", chat, {"model": model, "messages": user, "temperature": -2}, 400, None),
        ("POST", chat, {"model": model, "messages": user, "max_tokens": 0}, 400, None),
        (
            "POST",
            chat,
            {"model": model, "messages": user, "logprobs": True, "top_logprobs": 21},
            400,
            None,
        ),
        (
            "POST",
            chat,
            {"model": model, "messages": [{"role": "robot", "content": "x"}]},
            400,
            None,
        ),
        ("POST", chat, {"model": model, "messages": user, "unknown": True}, 400, None),
        (
            "POST",
            chat,
            {"model": model, "messages": [{"role": "user", "content": long_text}]},
            400,
            "context_length_exceeded",
        ),
    ]


def test_bad_input_gets_4xx_json_and_changes_nothing(api, acme, raw_redis, session_id):
    model = acme.get("/v1/models").json()["data"][0]["id"]
    prefix = api.services.settings.key_prefix
    before = keyspace(raw_redis, prefix)
    assert before  # the snapshot really covers the service's keys
    for method, path, body, status, error_type in _cases(session_id, model):
        if isinstance(body, bytes):
            response = acme.request(
                method, path, content=body, headers={"content-type": "application/json"}
            )
        else:
            response = acme.request(method, path, json=body)
        label = f"{method} {path} {str(body)[:60]}"
        assert response.status_code == status, (label, response.text)
        error = response.json()["error"]
        assert error["message"], label
        if error_type is not None:
            assert error["type"] == error_type, (label, error)
        assert keyspace(raw_redis, prefix) == before, label
