"""The openai SDK, unchanged, against the live server."""

from __future__ import annotations

import openai
import pytest

from tests.api.conftest import ACME_KEY, BLOCK_SIZE, unique


@pytest.fixture
def sdk(api):
    with openai.OpenAI(base_url=f"{api.url}/v1", api_key=ACME_KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def model(sdk) -> str:
    models = sdk.models.list().data
    assert len(models) == 1
    return models[0].id


def _messages(question: str) -> list[dict]:
    return [
        {"role": "system", "content": unique("You are a helpful assistant. Be brief.")},
        {"role": "user", "content": question},
    ]


def test_non_stream_reports_usage_and_cached_tokens(sdk, model):
    messages = _messages("What is the capital of France?")
    first = sdk.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert first.object == "chat.completion"
    choice = first.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = first.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0

    again = sdk.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=8, temperature=0
    )
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= (again.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0


def test_stream_chunks_and_usage(sdk, model):
    stream = sdk.chat.completions.create(
        model=model,
        messages=_messages("Count to three."),
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert text


def test_n_seed_and_stop(sdk, model):
    messages = _messages("Write a short poem about the sea.")
    kwargs = dict(model=model, messages=messages, max_tokens=12, temperature=1.0, seed=7)
    # Warm the prefix cache first, so both measured runs read the prompt's KV
    # from the same cached blocks.
    sdk.chat.completions.create(model=model, messages=messages, max_tokens=1)
    many = sdk.chat.completions.create(n=3, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.usage.completion_tokens >= 3
    # Same seed, same samples: sample i draws with seed + i whatever the batch.
    repeat = sdk.chat.completions.create(n=3, **kwargs)
    assert [c.message.content for c in many.choices] == [c.message.content for c in repeat.choices]

    stopped = sdk.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0, stop=[" ", "\n"]
    ).choices[0]
    assert stopped.finish_reason == "stop"
    assert " " not in stopped.message.content and "\n" not in stopped.message.content


def test_the_model_is_retrieved_by_its_id(sdk, model):
    assert sdk.models.retrieve(model) == sdk.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.models.retrieve("gpt-4o")
    assert missing.value.body["type"] == "model_not_found"


def test_errors_surface_as_sdk_exceptions(sdk, model):
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="no-such-model", messages=_messages("hi"))
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=_messages("hi"), temperature=-1)
    assert "temperature" in str(info.value)
    with openai.OpenAI(base_url=sdk.base_url, api_key="wrong-key-123", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
