"""The Responses API through the openai SDK, unchanged: real model, real Redis, real HTTP.

Cache assertions compare ``cached_tokens`` with the parent's history: a response
continues exactly its parent's stored tokens, so every full block of them
(prompt and answer, less the last sampled token, whose KV is never computed)
is a cache hit.
"""

from __future__ import annotations

import openai
import pytest

from tests.api.conftest import ACME_KEY, BLOCK_SIZE, GLOBEX_KEY, keyspace, unique


@pytest.fixture
def sdk(api):
    with openai.OpenAI(base_url=f"{api.url}/v1", api_key=ACME_KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def other_sdk(api):
    with openai.OpenAI(base_url=f"{api.url}/v1", api_key=GLOBEX_KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def model(sdk) -> str:
    return sdk.models.list().data[0].id


def _history_blocks(parent) -> int:
    """Tokens of the parent's history in full blocks: what a continuation finds cached."""
    usage = parent.usage
    return (usage.input_tokens + usage.output_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def _session_of(response) -> str:
    """The session a stored response lives in (its id names it: resp_<session>_<n>)."""
    return response.id.split("_")[1]


def _ask(sdk, model, text, **kwargs):
    return sdk.responses.create(
        model=model, input=text, max_output_tokens=6, temperature=0, **kwargs
    )


def test_create_retrieve_input_items_and_delete(sdk, model):
    question = unique("What is the capital of France?")
    created = _ask(sdk, model, question, instructions="Answer briefly.", metadata={"k": "v"})
    assert created.object == "response" and created.id.startswith("resp_")
    assert created.status in ("completed", "incomplete") and created.model == model
    (message,) = created.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and created.output_text
    usage = created.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens >= 1
    assert created.previous_response_id is None and created.instructions == "Answer briefly."
    assert created.metadata == {"k": "v"}

    again = sdk.responses.retrieve(created.id)
    assert again.output_text == created.output_text and again.output[0].id == message.id
    assert again.usage.input_tokens == usage.input_tokens and again.status == created.status
    items = sdk.responses.input_items.list(created.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", question)]

    sdk.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(created.id)


# A question of several blocks past the template head.
TRIP = "Plan my trip: trains, hotels, food, weather, museums and walks for each day. " * 4


def test_deleting_a_response_deletes_the_kv_of_its_text(sdk, model):
    question = unique(TRIP)
    sdk.responses.delete(_ask(sdk, model, question).id)
    again = _ask(sdk, model, question, store=False)
    fresh = _ask(sdk, model, unique(TRIP), store=False)
    head = fresh.usage.input_tokens_details.cached_tokens  # the template head, no more
    # The text asked again finds the head only (the uuid tag may share one more block by
    # chance); with its KV kept it would find nearly all of its input.
    assert again.usage.input_tokens_details.cached_tokens <= head + BLOCK_SIZE
    assert again.usage.input_tokens > head + 5 * BLOCK_SIZE


def test_a_chain_of_four_computes_only_each_new_turn(sdk, acme, model):
    previous = _ask(sdk, model, unique("Name a colour."), instructions="Be terse.")
    for n in range(3):
        response = _ask(
            sdk,
            model,
            f"And another one? ({n})",
            instructions="Be terse.",
            previous_response_id=previous.id,
        )
        assert response.previous_response_id == previous.id
        history = previous.usage.input_tokens + previous.usage.output_tokens
        assert response.usage.input_tokens > history - 1  # the whole history is in the prompt
        assert response.usage.input_tokens_details.cached_tokens >= _history_blocks(previous) > 0
        previous = response
    # The chain is one session's branch: all four turns, in order.
    messages = acme.get(f"/sessions/{_session_of(previous)}/messages").json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 4


def test_two_responses_on_one_previous_are_branches_sharing_its_kv(sdk, acme, model):
    root = _ask(sdk, model, unique("Pick a number."))
    left = _ask(sdk, model, "Double it.", previous_response_id=root.id)
    right = _ask(sdk, model, "Halve it.", previous_response_id=root.id)
    assert right.usage.input_tokens_details.cached_tokens >= _history_blocks(root) > 0
    assert left.id != right.id

    # Each branch continues from its own path: the left one never sees "Halve it."
    deeper = _ask(sdk, model, "Once more.", previous_response_id=left.id)
    assert deeper.usage.input_tokens_details.cached_tokens >= _history_blocks(left)
    path = acme.get(
        f"/sessions/{_session_of(root)}/messages", params={"leaf_id": deeper.output[0].id}
    ).json()["messages"]
    texts = [m["content"] for m in path if m["role"] == "user"]
    assert texts[1:] == ["Double it.", "Once more."]
    # The root's answer is stored once, with the two branches as its continuations.
    root_answer = next(m for m in path if m["id"] == root.output[0].id)
    assert len(root_answer["sibling_ids"]) == 1
    siblings = [m for m in path if m["content"] == "Double it."][0]["sibling_ids"]
    assert len(siblings) == 2
    assert sdk.responses.input_items.list(left.id).data[0].content[0].text == "Double it."


def test_streaming_sends_every_event_in_order_then_stores_the_response(sdk, model):
    stream = _ask(sdk, model, unique("Count to five."), stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    final = events[-1].response
    terminal = "response.incomplete" if final.status == "incomplete" else "response.completed"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        terminal,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-4].text == text == final.output_text
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}
    assert sdk.responses.retrieve(final.id).output_text == text


def test_a_stream_whose_turn_fails_to_store_ends_with_error_and_failed(
    api, sdk, model, monkeypatch
):
    store = api.services.store
    commit = store.branches.commit_turn

    async def lock_taken_then_commit(tenant_id, session_id, *args, **kwargs):
        await store.redis.set(store.keys.session_lock(session_id), "another-replica")
        return await commit(tenant_id, session_id, *args, **kwargs)

    first = _ask(sdk, model, unique("Hello there."))
    monkeypatch.setattr(store.branches, "commit_turn", lock_taken_then_commit)
    events = list(_ask(sdk, model, "Go on.", previous_response_id=first.id, stream=True))
    kinds = [e.type for e in events]
    assert kinds[-2:] == ["error", "response.failed"] and "response.completed" not in kinds
    assert events[-2].code == "turn_lock_lost"
    assert events[-1].response.status == "failed" and events[-1].response.error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    monkeypatch.setattr(store.branches, "commit_turn", commit)
    store_key = store.keys.session_lock(_session_of(first))
    api.call(store.redis.delete(store_key))
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(events[0].response.id)


def test_store_false_leaves_nothing_in_redis(api, sdk, model, raw_redis):
    prefix = api.services.settings.key_prefix
    parent = _ask(sdk, model, unique("Say a word."))
    before = keyspace(raw_redis, prefix)
    alone = _ask(sdk, model, unique("Another word."), store=False)
    continued = _ask(sdk, model, "And one more.", previous_response_id=parent.id, store=False)
    assert keyspace(raw_redis, prefix) == before
    assert continued.usage.input_tokens_details.cached_tokens >= _history_blocks(parent) > 0
    for response in (alone, continued):
        assert response.output_text
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(response.id)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format.type"),
        ({"truncation": "auto"}, "truncation"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
        ({"modalities": ["text"]}, "modalities"),
    ],
)
def test_unsupported_fields_are_refused_by_name_and_change_nothing(
    api, sdk, model, raw_redis, extra, named
):
    before = keyspace(raw_redis, api.services.settings.key_prefix)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model=model, input="Hi", max_output_tokens=2, extra_body=extra)
    assert named in refused.value.message
    assert keyspace(raw_redis, api.services.settings.key_prefix) == before


def test_neutral_values_of_unsupported_fields_are_accepted(sdk, model):
    response = sdk.responses.create(
        model=model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": unique("Hi.")}]}],
        max_output_tokens=2,
        tools=[],
        tool_choice="none",
        parallel_tool_calls=False,
        include=[],
        text={"format": {"type": "text"}},
        truncation="disabled",
    )
    assert response.output_text


def test_another_tenants_response_answers_exactly_like_an_unknown_one(sdk, other_sdk, model):
    mine = _ask(sdk, model, unique("A private question."))
    unknown = mine.id[:-4] + ("0000" if not mine.id.endswith("0000") else "1111")
    answers = []
    for rid in (mine.id, unknown):
        with pytest.raises(openai.NotFoundError) as lookup:
            other_sdk.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError) as chained:
            other_sdk.responses.create(
                model=model, input="hi", max_output_tokens=2, previous_response_id=rid
            )
        with pytest.raises(openai.NotFoundError) as items:
            other_sdk.responses.input_items.list(rid)
        with pytest.raises(openai.NotFoundError) as deleted:
            other_sdk.responses.delete(rid)
        answers.append([e.value.body for e in (lookup, chained, items, deleted)])
    assert answers[0] == answers[1]
    assert sdk.responses.retrieve(mine.id).output_text == mine.output_text


def test_chat_completions_carry_the_cache_key_and_log_caller_ids_only_as_hashes(sdk, model, caplog):
    caplog.set_level("INFO", logger="chatsvc.api.openai.caller_ids")
    raw = sdk.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": unique("Hi")}],
        max_tokens=2,
        prompt_cache_key="tenant-7/chat-42",
        safety_identifier="alice@example.com",
        user="user-alice@example.com",
    )
    assert raw.headers["x-prompt-cache-key"] == "tenant-7/chat-42"
    assert raw.parse().choices[0].message.content is not None
    streamed = sdk.responses.with_raw_response.create(
        model=model, input=unique("Hi"), max_output_tokens=2, prompt_cache_key="k-1"
    )
    assert streamed.headers["x-prompt-cache-key"] == "k-1"
    assert streamed.parse().prompt_cache_key == "k-1"
    lines = "\n".join(r.getMessage() for r in caplog.records)
    assert "prompt_cache_key h:" in lines and "safety_identifier h:" in lines
    assert "alice@example.com" not in lines and "tenant-7/chat-42" not in lines
    with pytest.raises(openai.BadRequestError, match="prompt_cache_key"):
        sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            prompt_cache_key="bad\nheader",
        )


def test_input_items_read_only_their_page(api, sdk, model, monkeypatch):
    """Regression (issue 25): every input message was read from Redis and the page cut in
    Python; now only the page's messages are read."""
    texts = [unique(f"Line {i}.") for i in range(4)]
    created = sdk.responses.create(
        model=model,
        input=[{"role": "user", "content": t} for t in texts],
        max_output_tokens=2,
        temperature=0,
    )
    tree = api.services.store.tree
    read = tree.messages_by_id
    asked: list[list[str]] = []

    async def spy(tenant_id, session_id, ids):
        asked.append(list(ids))
        return await read(tenant_id, session_id, ids)

    monkeypatch.setattr(tree, "messages_by_id", spy)
    newest = sdk.responses.input_items.list(created.id, limit=1)
    assert [i.content[0].text for i in newest.data] == [texts[-1]] and newest.has_more
    rest = sdk.responses.input_items.list(created.id, limit=2, after=newest.last_id)
    assert [i.content[0].text for i in rest.data] == [texts[2], texts[1]] and rest.has_more
    oldest = sdk.responses.input_items.list(created.id, order="asc", limit=10)
    assert [i.content[0].text for i in oldest.data] == texts and not oldest.has_more
    assert [len(ids) for ids in asked] == [1, 2, 4]
