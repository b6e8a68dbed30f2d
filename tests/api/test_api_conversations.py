"""The Conversations API through the openai SDK: a conversation is a session (real model, Redis)."""

from __future__ import annotations

import openai
import pytest

from chatsvc.chat_client import iter_sse
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


USER_ITEM = {"role": "user", "content": "x"}


def _texts(items) -> list[tuple[str, str]]:
    return [(i.role, i.content[0].text) for i in items]


def test_items_responses_and_the_session_underneath(sdk, acme, model):
    first = unique("My name is Ada.")
    conversation = sdk.conversations.create(
        items=[
            {"role": "system", "content": "You are terse."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": first}]},
            {"role": "assistant", "content": "Hello Ada."},
        ],
        metadata={"topic": "intro"},
    )
    assert conversation.object == "conversation" and conversation.metadata == {"topic": "intro"}
    cid = conversation.id

    # A response in the conversation sees its items and appends its input and answer.
    answer = sdk.responses.create(
        model=model, conversation=cid, input="What is my name?", max_output_tokens=6, temperature=0
    )
    assert answer.conversation.id == cid
    items = sdk.conversations.items.list(cid, order="asc")
    assert _texts(items.data)[:4] == [
        ("system", "You are terse."),
        ("user", first),
        ("assistant", "Hello Ada."),
        ("user", "What is my name?"),
    ]
    assert items.data[-1].id == answer.output[0].id and items.data[-1].role == "assistant"
    assert items.data[-1].content[0].text == answer.output_text

    # The next response reuses everything the first one computed.
    again = sdk.responses.create(
        model=model, conversation=cid, input="Spell it.", max_output_tokens=4, temperature=0
    )
    history = answer.usage.input_tokens + answer.usage.output_tokens
    assert again.usage.input_tokens_details.cached_tokens >= (history - 1) // 16 * 16 > 0

    # The same conversation, seen as a session.
    session = acme.get(f"/sessions/{cid}").json()
    assert session["num_messages"] == 7 and session["metadata"] == {"topic": "intro"}
    native = acme.get(f"/sessions/{cid}/messages").json()["messages"]
    listed = sdk.conversations.items.list(cid, order="asc")
    assert [m["id"] for m in native] == [i.id for i in listed]

    # Paging newest first, then one item, metadata, deleting an item, the whole thing.
    page = sdk.conversations.items.list(cid, limit=2)
    assert len(page.data) == 2 and page.has_more and page.data[0].id == again.output[0].id
    rest = sdk.conversations.items.list(cid, limit=10, after=page.last_id)
    assert len(rest.data) == 5 and not rest.has_more
    assert sdk.conversations.items.retrieve(page.data[1].id, conversation_id=cid).role == "user"
    updated = sdk.conversations.update(cid, metadata={"topic": "names"})
    assert sdk.conversations.retrieve(cid).metadata == {"topic": "names"} == updated.metadata
    sdk.conversations.items.delete(native[2]["id"], conversation_id=cid)
    remaining = sdk.conversations.items.list(cid, order="asc").data
    assert native[2]["id"] not in [i.id for i in remaining] and len(remaining) == 6
    follow = sdk.responses.create(
        model=model, conversation=cid, input="Thanks.", max_output_tokens=2, temperature=0
    )
    assert follow.output_text is not None
    deleted = sdk.conversations.delete(cid)
    assert deleted.deleted and deleted.id == cid
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(cid)
    assert acme.get(f"/sessions/{cid}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(answer.id)


TRIP = "Plan my trip: trains, hotels, food, weather, museums and walks for each day. " * 4


def _ask(sdk, model, text, **kwargs):
    return sdk.responses.create(
        model=model, input=text, max_output_tokens=6, temperature=0, **kwargs
    )


def test_deleting_a_conversation_deletes_the_kv_of_its_text(sdk, model):
    question = unique(TRIP)
    cid = sdk.conversations.create().id
    _ask(sdk, model, question, conversation=cid)
    sdk.conversations.delete(cid)
    again = _ask(sdk, model, question, store=False)  # the same prompt as the turn's
    fresh = _ask(sdk, model, unique(TRIP), store=False)
    head = fresh.usage.input_tokens_details.cached_tokens  # the template head, no more
    assert again.usage.input_tokens_details.cached_tokens <= head + BLOCK_SIZE
    assert again.usage.input_tokens > head + 5 * BLOCK_SIZE


def test_added_items_are_stored_without_generating_and_rendered_by_the_next_turn(sdk, model):
    conversation = sdk.conversations.create()
    added = sdk.conversations.items.create(
        conversation.id,
        items=[
            {"role": "user", "content": unique("Remember the number 7.")},
            {"role": "assistant", "content": "Noted: 7."},
        ],
    )
    assert [i.role for i in added.data] == ["user", "assistant"]
    response = sdk.responses.create(
        model=model, conversation=conversation.id, input="Which number?", max_output_tokens=4
    )
    # The prompt holds the added items' text: far longer than the question alone.
    alone = sdk.responses.create(
        model=model, input="Which number?", max_output_tokens=1, store=False
    )
    assert response.usage.input_tokens > alone.usage.input_tokens + 10


def test_a_conversation_runs_one_turn_at_a_time(api, sdk, model):
    conversation = sdk.conversations.create()
    body = {
        "model": model,
        "conversation": conversation.id,
        "input": unique("Tell a long story."),
        "max_output_tokens": 48,
        "stream": True,
    }
    with api_client(api) as http, http.stream("POST", "/v1/responses", json=body) as running:
        lines = running.iter_lines()
        events = iter_sse(lines)
        while next(events)[0] != "response.output_text.delta":
            pass  # the turn holds the conversation from here on
        with pytest.raises(openai.ConflictError):
            sdk.responses.create(
                model=model, conversation=conversation.id, input="Me too!", max_output_tokens=2
            )
        with pytest.raises(openai.ConflictError):
            sdk.conversations.items.create(conversation.id, items=[USER_ITEM])
        assert [kind for kind, _ in events][-1] in ("response.completed", "response.incomplete")
    items = sdk.conversations.items.list(conversation.id, order="asc").data
    assert [i.role for i in items] == ["user", "assistant"]


def test_another_tenants_conversation_answers_exactly_like_an_unknown_one(
    api, sdk, other_sdk, raw_redis, model
):
    mine = sdk.conversations.create(items=[{"role": "user", "content": unique("secret")}])
    item = sdk.conversations.items.list(mine.id).data[0]
    unknown = "0" * 32
    before = keyspace(raw_redis, api.services.settings.key_prefix)
    bodies = []
    for cid in (mine.id, unknown):
        conversations = other_sdk.conversations
        calls = [
            (conversations.retrieve, (cid,), {}),
            (conversations.update, (cid,), {"metadata": {"x": "y"}}),
            (conversations.delete, (cid,), {}),
            (conversations.items.list, (cid,), {}),
            (conversations.items.create, (cid,), {"items": [USER_ITEM]}),
            (conversations.items.retrieve, (item.id,), {"conversation_id": cid}),
            (conversations.items.delete, (item.id,), {"conversation_id": cid}),
            (
                other_sdk.responses.create,
                (),
                {"model": model, "conversation": cid, "input": "hi", "max_output_tokens": 2},
            ),
        ]
        found = []
        for call, args, kwargs in calls:
            with pytest.raises(openai.NotFoundError) as refused:
                call(*args, **kwargs)
            found.append(refused.value.body)
        bodies.append(found)
    assert bodies[0] == bodies[1]
    assert keyspace(raw_redis, api.services.settings.key_prefix) == before
    assert sdk.conversations.items.list(mine.id).data[0].id == item.id


def api_client(api):
    from tests.api.conftest import client

    return client(api, ACME_KEY)
