"""The client's SSE parsing and history handling, over an in-process HTTP transport."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bench.multiturn.client import RequestRecord, ServerError, run_workload, stream_chat
from bench.multiturn.workload import Distribution, WorkloadConfig, generate_workload


def _sse(events: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _answer_events(words: list[str], prompt: int, cached: int | None) -> list[dict]:
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in words]
    usage = {"prompt_tokens": prompt, "completion_tokens": len(words), "total_tokens": 0}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    events.append({"choices": [], "usage": usage})
    return events


def test_stream_fills_record():
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0 and body["max_tokens"] == 3 and body["model"] == "m"
        return httpx.Response(200, content=_sse(_answer_events(["a", "b", "c"], 40, 32)))

    async def go():
        record = RequestRecord("x", "c0", 0, 0.0, max_tokens=3)
        async with httpx.AsyncClient(
            transport=httpx.MockTransport(handler), base_url="http://t"
        ) as h:
            await stream_chat(h, [{"role": "user", "content": "q"}], record, "m", 0.0)
        return record

    record = asyncio.run(go())
    assert record.answer == "abc" and record.finish_reason == "length"
    assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (40, 32, 3)
    assert 0 <= record.ttft_s <= record.latency_s
    assert record.tpot_s == pytest.approx((record.latency_s - record.ttft_s) / 2)


@pytest.mark.parametrize(
    "response",
    [
        httpx.Response(500, content=b"boom"),
        httpx.Response(200, content=_sse([{"error": "cb worker died"}])),
    ],
)
def test_server_errors_raise(response):
    async def go():
        transport = httpx.MockTransport(lambda request: response)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as h:
            await stream_chat(h, [], RequestRecord("x", "c0", 0, 0.0, max_tokens=1), None, 0.0)

    with pytest.raises(ServerError):
        asyncio.run(go())


def test_conversation_resends_history_with_real_answers():
    config = WorkloadConfig(
        num_conversations=2, num_turns=3, think_time_s=Distribution.parse("0"), seed=5
    )
    workload = generate_workload(config)
    seen: list[list[dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        messages = json.loads(request.content)["messages"]
        seen.append(messages)
        turn = sum(1 for m in messages if m["role"] == "user")
        return httpx.Response(200, content=_sse(_answer_events([f"ans{turn}"], 10 * turn, None)))

    result = asyncio.run(
        run_workload("http://t", workload, "fake", 2, transport=httpx.MockTransport(handler))
    )
    assert len(result.records) == 6 and all(r.ok for r in result.records)
    assert all(r.cached_tokens is None for r in result.records)
    last = max(seen, key=len)
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in last if m["role"] == "assistant"] == ["ans1", "ans2"]
    conv = next(c for c in workload.conversations if c.system_prompt == last[0]["content"])
    assert [m["content"] for m in last if m["role"] == "user"] == list(conv.user_turns)


def test_failed_turn_ends_its_conversation():
    workload = generate_workload(
        WorkloadConfig(num_conversations=1, num_turns=4, think_time_s=Distribution.parse("0"))
    )
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) == 2:
            return httpx.Response(503, content=b"busy")
        return httpx.Response(200, content=_sse(_answer_events(["x"], 5, 0)))

    result = asyncio.run(
        run_workload("http://t", workload, "fake", 1, transport=httpx.MockTransport(handler))
    )
    assert [r.ok for r in result.records] == [True, False]
    assert "503" in result.records[1].error


def test_deadline_cuts_the_run_and_marks_requests_in_flight():
    workload = generate_workload(
        WorkloadConfig(num_conversations=2, num_turns=3, think_time_s=Distribution.parse("0"))
    )

    async def handler(request: httpx.Request) -> httpx.Response:
        turn = sum(1 for m in json.loads(request.content)["messages"] if m["role"] == "user")
        if turn == 2:
            await asyncio.sleep(30)  # the second turn never finishes before the deadline
        return httpx.Response(200, content=_sse(_answer_events(["x"], 5, 0)))

    result = asyncio.run(
        run_workload(
            "http://t", workload, "fake", 2, transport=httpx.MockTransport(handler), deadline_s=0.5
        )
    )
    assert result.truncated and result.to_json()["truncated"] and result.wall_s < 30
    assert sorted((r.turn, r.ok, r.cut_at_deadline) for r in result.records) == [
        (0, True, False),
        (0, True, False),
        (1, False, True),
        (1, False, True),
    ]
    assert all(r.error is None for r in result.records)
