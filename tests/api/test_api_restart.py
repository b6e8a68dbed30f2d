"""Persistence: the service and Redis each die hard and come back; no acknowledged turn is lost.

The service runs as ``python -m chatsvc serve`` (a child process), on its own
Redis with the append-only file fsynced on every write.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from bench.live_server import ProcessServer
from chatsvc.store.embedded import EmbeddedRedis
from tests.redis_server import unique_prefix

KEY = "restart-tenant-key-01"


@pytest.fixture(scope="module")
def redis_aof(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("aof"), appendfsync="always") as server:
        yield server


@pytest.fixture(scope="module")
def service_env(redis_aof) -> dict[str, str]:
    return {
        "CHATSVC_REDIS_URL": redis_aof.url,
        "CHATSVC_KEY_PREFIX": unique_prefix("restart"),
        "CHATSVC_API_KEYS": f"acme:{KEY}",
        "CHATSVC_HOST": "127.0.0.1",
        "CHATSVC_NUM_GPU_BLOCKS": "256",
        "CHATSVC_MAX_MODEL_LEN": "1024",
        "CHATSVC_MAX_TOKENS_CAP": "64",
    }


@pytest.fixture(scope="module")
def service(service_env, tmp_path_factory):
    server = ProcessServer(service_env, tmp_path_factory.mktemp("svc") / "chatsvc.log")
    server.start()
    yield server
    server.stop()


def _client(server: ProcessServer) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300
    )


def _turn(http: httpx.Client, sid: str, text: str) -> dict:
    response = http.post(
        f"/sessions/{sid}/messages", json={"content": text, "max_tokens": 8, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    return response.json()


def _history(http: httpx.Client, sid: str) -> list[dict]:
    response = http.get(f"/sessions/{sid}/messages")
    assert response.status_code == 200, response.text
    return response.json()["messages"]


def test_service_killed_and_restarted_keeps_the_conversation(service):
    with _client(service) as http:
        sid = http.post("/sessions", json={"system_prompt": "You are brief."}).json()["id"]
        for text in ("Hello!", "What is 2+2?", "And 3+3?"):
            _turn(http, sid, text)
        history = _history(http, sid)
        tokens = http.get(f"/sessions/{sid}").json()["num_tokens"]
    assert [m["role"] for m in history] == ["system"] + ["user", "assistant"] * 3

    service.kill()  # SIGKILL: no shutdown hook runs
    service.start()

    with _client(service) as http:
        assert _history(http, sid) == history
        assert http.get(f"/sessions/{sid}").json()["num_tokens"] == tokens
        fourth = _turn(http, sid, "And 4+4?")
        assert fourth["message"]["content"] == _history(http, sid)[-1]["content"]
        assert fourth["prefix_reused"] is True  # the stored tokens are extended, not re-rendered
        assert len(_history(http, sid)) == len(history) + 2


def test_redis_killed_and_restarted_loses_no_acknowledged_turn(service, redis_aof):
    with _client(service) as http:
        sid = http.post("/sessions", json={}).json()["id"]
        acknowledged = [_turn(http, sid, text)["message"]["content"] for text in ("Hi", "Bye")]
        history = _history(http, sid)
        assert [m["content"] for m in history if m["role"] == "assistant"] == acknowledged

        redis_aof.kill()  # SIGKILL the server: only what the AOF holds survives
        down = http.get(f"/sessions/{sid}/messages")
        assert down.status_code == 503
        assert down.json()["error"]["type"] == "store_unavailable"
        redis_aof.start()  # same data dir, same port

        assert _history(http, sid) == history
        _turn(http, sid, "Again")
        assert len(_history(http, sid)) == len(history) + 2


def test_response_chains_and_conversations_continue_after_kill_9(service):
    def sdk() -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{service.url}/v1", api_key=KEY, max_retries=0)

    options = {"max_output_tokens": 6, "temperature": 0}
    with sdk() as client:
        model = client.models.list().data[0].id
        first = client.responses.create(model=model, input="Hello!", **options)
        second = client.responses.create(
            model=model, input="And then?", previous_response_id=first.id, **options
        )
        conversation = client.conversations.create(
            items=[{"role": "user", "content": "Remember the number 7."}]
        )
        asked = client.responses.create(
            model=model, conversation=conversation.id, input="Which number?", **options
        )
        items = [i.id for i in client.conversations.items.list(conversation.id, order="asc")]
    session_id = second.id.split("_")[1]
    with _client(service) as http:
        tokens = http.get(f"/sessions/{session_id}").json()["num_tokens"]

    service.kill()  # SIGKILL: no shutdown hook runs
    service.start()

    with sdk() as client:
        assert client.responses.retrieve(second.id).output_text == second.output_text
        third = client.responses.create(
            model=model, input="Go on.", previous_response_id=second.id, **options
        )
        # The chain's stored tokens are the third prompt's head: it only grew.
        assert third.usage.input_tokens > tokens
        assert [i.content[0].text for i in client.responses.input_items.list(third.id)] == [
            "Go on."
        ]
        listed = client.conversations.items.list(conversation.id, order="asc").data
        assert [i.id for i in listed] == items and listed[-1].content[0].text == asked.output_text
        client.responses.create(
            model=model, conversation=conversation.id, input="Thanks.", **options
        )
        assert len(client.conversations.items.list(conversation.id).data) == len(items) + 2
    with _client(service) as http:
        messages = http.get(f"/sessions/{session_id}/messages").json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3
