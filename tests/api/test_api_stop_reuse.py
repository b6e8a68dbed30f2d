"""A turn ended by a client's stop string stores text and tokens that agree, so every
later turn still extends the stored tokens and reuses their cached KV."""

from __future__ import annotations

import pytest

from tests.api.conftest import ACME_KEY, BLOCK_SIZE, new_session, say, unique
from tests.api.engine_recorder import record_engine

QUESTION = "Tell me about the moon."
# The stop string cuts this far into the answer, so its kept tokens fill a block.
MIN_KEPT = BLOCK_SIZE


@pytest.fixture
def recorded(api, monkeypatch):
    return record_engine(monkeypatch, api.services.engine)


def _stop_inside_a_token(chat_format, token_ids: list[int], text: str) -> tuple[str, int]:
    """A stop string that starts one character into a generated token: (stop, token index)."""
    offset = 0
    for index, token_id in enumerate(token_ids):
        piece = chat_format.decode([token_id])
        stop = piece[1:]
        if (
            index >= MIN_KEPT
            and len(stop) >= 2
            and stop.isalpha()
            and text.find(stop) == offset + 1
        ):
            return stop, index
        offset += len(piece)
    raise AssertionError(f"no token to cut inside in {text!r}")


def test_turns_after_a_stop_string_still_reuse_the_history(api, acme, recorded):
    chat_format = api.services.engine.chat_format
    system = unique("You are a helpful assistant.")
    # What the model answers here, greedy, without a stop string. Asked twice: the
    # second probe finds the first one's prompt blocks cached, exactly as the turn
    # below will, so it computes the same logits (bf16 KV computed in other chunks
    # differs in its last bits, and greedy decoding may then part ways).
    say(acme, new_session(acme, system_prompt=system)["id"], QUESTION, max_tokens=48)
    probe = say(acme, new_session(acme, system_prompt=system)["id"], QUESTION, max_tokens=48)
    stop, _ = _stop_inside_a_token(
        chat_format, recorded[-1].output_token_ids, probe["message"]["content"]
    )

    session = new_session(acme, system_prompt=system)
    first = say(acme, session["id"], QUESTION, max_tokens=48, stop=[stop])
    assert first["finish_reason"] == "stop" and stop not in first["message"]["content"]
    generated = recorded[-1].output_token_ids

    second = say(acme, session["id"], unique("Thanks. And you?"), max_tokens=8)
    assert second["prefix_reused"] is True
    # Cached: every full block up to the cut, the answer's own blocks among them.
    kept = len(generated) - 1  # the last token completed the stop string
    computed = first["usage"]["prompt_tokens"] + kept
    assert computed // BLOCK_SIZE > first["usage"]["prompt_tokens"] // BLOCK_SIZE
    assert second["usage"]["cached_tokens"] >= computed // BLOCK_SIZE * BLOCK_SIZE
    third = say(acme, session["id"], unique("Goodbye."), max_tokens=8)
    assert third["prefix_reused"] is True
    computed = second["usage"]["prompt_tokens"] + second["usage"]["completion_tokens"] - 1
    assert third["usage"]["cached_tokens"] >= computed // BLOCK_SIZE * BLOCK_SIZE

    store = api.services.store
    tenant_id = api.services.tenants.tenant_for_key(ACME_KEY).id
    answer = api.call(store.tree.messages(tenant_id, session["id"]))[2]
    # Stored: the text up to the stop, and tokens that spell exactly that text,
    # starting with every generated token that lies wholly before the cut.
    assert answer.role == "assistant" and answer.text == first["message"]["content"]
    assert chat_format.decode(answer.token_ids) == answer.text
    assert answer.token_ids[:kept] == generated[:kept]
    # Each stored history is a token prefix of the next prompt.
    prompts = [r.request.prompt_token_ids for r in recorded[-3:]]
    history = prompts[0] + answer.token_ids
    assert prompts[1][: len(history)] == history
