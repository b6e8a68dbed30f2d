"""Beam search through the API: the native turn stores the best beam, /v1/chat/completions
returns the n best as choices, a stream carries each whole at the end, bad requests are a
400 that changes nothing, and a client that leaves frees every beam."""

from __future__ import annotations

import json

import openai
import pytest

from bench.live_server import wait_until
from chatsvc.chat_client import iter_sse
from tests.api.conftest import ACME_KEY, keyspace, new_session, say, unique

QUESTION = "Name three colours of the rainbow."


@pytest.fixture
def sdk(api):
    with openai.OpenAI(base_url=f"{api.url}/v1", api_key=ACME_KEY, max_retries=0) as client:
        yield client


def beams_of(sdk, api, messages, width, n, **fields):
    return sdk.chat.completions.create(
        model=api.services.engine.model_name,
        messages=messages,
        max_tokens=10,
        n=n,
        extra_body={"beam_width": width, **fields},
    )


def test_a_turn_stores_the_best_beam_and_the_next_turn_builds_on_it(api, acme, sdk):
    system = unique("You are terse.")
    sid = new_session(acme, system_prompt=system)["id"]
    turn = say(acme, sid, QUESTION, max_tokens=10, beam_width=3, length_penalty=0.8)
    # The same conversation through the OpenAI side, its prompt now found cached (the
    # kernels' values do not depend on it: kernels/invariance.py): the turn's answer
    # is its best beam.
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    choices = beams_of(sdk, api, messages, 3, 3, length_penalty=0.8).choices
    assert [c.index for c in choices] == [0, 1, 2]
    assert turn["message"]["content"] == choices[0].message.content
    assert len({c.message.content for c in choices}) == 3  # three different beams
    assert turn["finish_reason"] == choices[0].finish_reason
    history = acme.get(f"/sessions/{sid}/messages").json()["messages"]
    assert history[-1]["content"] == turn["message"]["content"]
    after = say(acme, sid, "And one more?", max_tokens=4, beam_width=2)
    assert after["prefix_reused"] is True and after["usage"]["cached_tokens"] > 0
    assert api.services.engine.cache_stats()["device"]["used"] == 0


def test_a_stream_carries_each_beam_whole_at_the_end(acme, sdk, api):
    sid = new_session(acme)["id"]
    body = {"content": unique(QUESTION), "stream": True, "max_tokens": 8, "beam_width": 2}
    with acme.stream("POST", f"/sessions/{sid}/messages", json=body) as response:
        assert response.status_code == 200
        events = [(e, json.loads(data)) for e, data in iter_sse(response.iter_lines())]
    assert [e for e, _ in events] == ["delta", "done"]
    assert events[0][1]["text"] == events[1][1]["message"]["content"]

    stream = sdk.chat.completions.create(
        model=api.services.engine.model_name,
        messages=[{"role": "user", "content": unique(QUESTION)}],
        max_tokens=8,
        n=2,
        stream=True,
        extra_body={"beam_width": 3},
    )
    chunks = list(stream)
    assert [c.choices[0].delta.role for c in chunks[:1]] == ["assistant"]
    finals = [c.choices[0] for c in chunks[1:]]
    assert [f.index for f in finals] == [0, 1]  # best first, each one chunk
    assert all(f.delta.content and f.finish_reason for f in finals)


BAD = [
    ({"beam_width": 9}, "beam_width"),
    ({"beam_width": 0}, "beam_width"),
    ({"beam_width": 2, "temperature": 0.7}, "temperature must be 0"),
    ({"beam_width": 2, "top_p": 0.5}, "top_p"),
    ({"beam_width": 2, "stop": ["x"]}, "stop strings"),
    ({"beam_width": 2, "length_penalty": 9.0}, "length_penalty"),
    ({"beam_width": 2, "early_stopping": "always"}, "early_stopping"),
    ({"length_penalty": 0.5}, "beam search only"),
]


def test_bad_beam_fields_are_a_400_and_change_nothing(api, acme, raw_redis):
    sid = new_session(acme)["id"]
    say(acme, sid, unique("Hello."), max_tokens=2)
    prefix = api.services.settings.key_prefix
    before = keyspace(raw_redis, prefix)
    for fields, named in BAD:
        body = {"content": "Hi", "max_tokens": 4, **fields}
        response = acme.post(f"/sessions/{sid}/messages", json=body)
        assert response.status_code == 400, (fields, response.text)
        assert named in response.json()["error"]["message"], (fields, response.text)
    # The width caps at the server's n cap (4 here), as n samples do.
    response = acme.post(
        f"/sessions/{sid}/messages", json={"content": "Hi", "max_tokens": 4, "beam_width": 5}
    )
    assert response.status_code == 400 and "cap" in response.json()["error"]["message"]
    assert keyspace(raw_redis, prefix) == before
    assert api.services.engine.cache_stats()["device"]["used"] == 0


def test_chat_completions_refuses_n_above_the_width(sdk, api):
    with pytest.raises(openai.BadRequestError, match=r"n \(3\) must not exceed beam_width"):
        beams_of(sdk, api, [{"role": "user", "content": "Hi"}], 2, 3)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        sdk.chat.completions.create(
            model=api.services.engine.model_name,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            logprobs=True,
            extra_body={"beam_width": 2},
        )


def test_a_client_that_leaves_mid_search_frees_every_beam(api, acme):
    engine = api.services.engine
    sid = new_session(acme)["id"]
    before = acme.get(f"/sessions/{sid}/messages").json()
    body = {"content": unique("Tell a very long story."), "stream": True, "max_tokens": 64}
    with acme.stream(
        "POST", f"/sessions/{sid}/messages", json={**body, "beam_width": 4}
    ) as response:
        assert response.status_code == 200
        wait_until(lambda: engine.cache_stats()["num_sequences"] >= 4, 60, "the search to fork")
    # The connection closed mid-search: the engine aborts it and frees every beam.
    wait_until(lambda: engine.cache_stats()["num_sequences"] == 0, 60, "the beams to go")
    assert engine.cache_stats()["device"]["used"] == 0
    assert acme.get(f"/sessions/{sid}/messages").json() == before
    assert say(acme, sid, unique("Still there?"), max_tokens=2)["finish_reason"]
