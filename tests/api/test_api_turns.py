"""Turns: cache reuse across turns, SSE streaming, one turn at a time, disconnects."""

from __future__ import annotations

import json

from bench.live_server import wait_until
from chatsvc.chat_client import iter_sse
from tests.api.conftest import BLOCK_SIZE, new_session, say, unique


def test_later_turns_reuse_the_cached_conversation(acme):
    session = new_session(acme, system_prompt=unique("You are a helpful assistant."))
    turns = [
        say(acme, session["id"], text, max_tokens=12)
        for text in ("Name a colour.", "Name a fruit.", "Name an animal.")
    ]
    assert turns[0]["usage"]["cached_tokens"] == 0
    for before, turn in zip(turns, turns[1:], strict=False):
        assert turn["prefix_reused"] is True
        # Everything the previous turn computed (its prompt and all generated
        # tokens but the last, whose KV is never written) lies in full blocks
        # that the new prompt starts with.
        computed = before["usage"]["prompt_tokens"] + before["usage"]["completion_tokens"] - 1
        assert turn["usage"]["cached_tokens"] >= computed // BLOCK_SIZE * BLOCK_SIZE
        assert turn["usage"]["prompt_tokens"] > computed
    for turn in turns:
        assert turn["timings"]["ttft_s"] > 0
        assert turn["usage"]["completion_tokens"] <= 12


def _stream(http, session_id: str, text: str, **options):
    body = {"content": text, "stream": True, "temperature": 0, "max_tokens": 16, **options}
    return http.stream("POST", f"/sessions/{session_id}/messages", json=body)


def test_sse_stream_sends_deltas_then_the_stored_result(acme):
    session = new_session(acme)
    with _stream(acme, session["id"], unique("Count from one to five.")) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [(event, json.loads(data)) for event, data in iter_sse(response.iter_lines())]
    kinds = [event for event, _ in events]
    assert kinds[-1] == "done" and set(kinds[:-1]) == {"delta"}
    done = events[-1][1]
    text = "".join(data["text"] for event, data in events if event == "delta")
    assert text == done["message"]["content"]
    assert done["usage"]["completion_tokens"] >= 1
    history = acme.get(f"/sessions/{session['id']}/messages").json()["messages"]
    assert history[-1]["content"] == text


def test_a_second_message_while_generating_gets_409(acme):
    session = new_session(acme)
    with _stream(acme, session["id"], unique("Tell a long story."), max_tokens=48) as first:
        lines = first.iter_lines()
        assert next(iter_sse(lines))[0] == "delta"  # generation is under way
        busy = acme.post(
            f"/sessions/{session['id']}/messages", json={"content": "Me too!", "max_tokens": 2}
        )
        assert busy.status_code == 409
        assert busy.json()["error"]["type"] == "session_busy"
        rest = [event for event, _ in iter_sse(lines)]
    assert rest[-1] == "done"
    history = acme.get(f"/sessions/{session['id']}/messages").json()["messages"]
    assert [m["role"] for m in history] == ["user", "assistant"]  # never interleaved


def test_disconnect_cancels_and_the_turn_is_not_stored(api, acme):
    session = new_session(acme)
    sid = session["id"]
    say(acme, sid, unique("First question."))
    before = acme.get(f"/sessions/{sid}/messages").json()
    tokens_before = acme.get(f"/sessions/{sid}").json()["num_tokens"]
    tenant_id = api.services.tenants.tenant_for_key("acme-secret-key-0001").id

    with _stream(acme, sid, unique("Tell a very long story."), max_tokens=64) as response:
        assert next(iter_sse(response.iter_lines()))[0] == "delta"
    # Leaving the block closed the connection mid-stream. The server aborts the
    # generation, frees the tenant's slot and the lock; nothing is appended.
    wait_until(lambda: api.services.streams.active(tenant_id) == 0, 60, "the stream to end")
    wait_until(
        lambda: api.call(_no_running_sequences(api.services.engine)), 60, "blocks to be freed"
    )
    assert acme.get(f"/sessions/{sid}/messages").json() == before
    assert acme.get(f"/sessions/{sid}").json()["num_tokens"] == tokens_before
    # The session is usable at once: the lock was released, not left to expire.
    after = say(acme, sid, unique("Second question."))
    assert after["prefix_reused"] is True
    api.call(_check_integrity(api.services.engine))


async def _no_running_sequences(engine) -> bool:
    return engine.cache_stats()["num_sequences"] == 0


async def _check_integrity(engine) -> None:
    engine.check_integrity()
