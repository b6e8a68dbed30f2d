"""ChatFormat: template rendering, token-exact extension of a conversation, stop tokens."""

from __future__ import annotations

import pytest

from chatsvc.engine.chat_format import ChatFormat
from chatsvc.engine.loader import load_tokenizer

TURNS = [
    ("What is 2 + 2?", "2 + 2 equals 4."),
    ("And times three?", "4 times 3 is 12."),
    ("Thanks! Anything else?", "You're welcome, happy to help."),
]


@pytest.fixture(scope="module")
def chat(smollm2_fp32) -> ChatFormat:
    return ChatFormat(smollm2_fp32.tokenizer, smollm2_fp32.config.eos_token_ids)


def _generated(chat: ChatFormat, text: str) -> list[int]:
    # What a generation leaves in the session: the answer's tokens and the stop token.
    return chat.tokenize(text) + [chat.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_stop_tokens_include_end_of_turn(chat):
    im_end = chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in chat.stop_token_ids
    assert chat.tokenizer.eos_token_id in chat.stop_token_ids


def test_render_uses_template_and_default_system_prompt(chat):
    ids = chat.render([{"role": "user", "content": "Hi"}])
    text = chat.decode(ids)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2 injects its default system prompt
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = chat.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt and len(ids) > len(no_prompt)


def test_extend_over_three_turns_adds_only_new_tokens(chat):
    messages: list[dict[str, str]] = []
    prev: list[int] = []
    for turn, (question, answer) in enumerate(TURNS):
        messages.append({"role": "user", "content": question})
        ids, reused = chat.extend(prev, messages)
        assert reused == (turn > 0)
        assert ids[: len(prev)] == prev
        # The new part is exactly the template's text for the new turn, nothing repeated.
        new_text = chat.decode(ids[len(prev) :])
        assert question in new_text and (turn == 0 or TURNS[turn - 1][1] not in new_text)
        assert chat.decode(ids) == chat.decode(chat.render(messages))
        prev = ids + _generated(chat, answer)
        messages.append({"role": "assistant", "content": answer})


def test_extend_keeps_previous_tokens_even_when_retokenizing_differs(chat):
    # " 12" could tokenize differently in context; the cached tokens must survive as given.
    messages = [{"role": "user", "content": "Count"}]
    prompt = chat.render(messages)
    odd = [chat.tokenizer.convert_tokens_to_ids(t) for t in ["1", "2"]]  # "12" split in two
    prev = prompt + odd + _generated(chat, "")
    messages += [{"role": "assistant", "content": "12"}, {"role": "user", "content": "More"}]
    ids, reused = chat.extend(prev, messages)
    assert reused and ids[: len(prev)] == prev


def test_template_that_rewrites_history_is_not_reused(smollm2_fp32):
    tokenizer = load_tokenizer(smollm2_fp32.path)  # a private copy: we change its template
    # Drops earlier assistant turns' reasoning, like templates of reasoning models do.
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatFormat(tokenizer)
    first = [{"role": "user", "content": "Hi"}]
    answer = "<think>greet back</think>Hello!"
    prev = chat.render(first) + _generated(chat, answer)
    history = first + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Bye"},
    ]
    ids, reused = chat.extend(prev, history)
    assert not reused
    assert ids == chat.render(history)
    assert "greet back" not in chat.decode(ids)


@pytest.mark.parametrize(
    "messages",
    [[], "hello", [{"role": "user"}], [{"content": "x"}], [{"role": "user", "content": 3}]],
)
def test_bad_messages_raise(chat, messages):
    with pytest.raises(ValueError):
        chat.render(messages)


def test_out_of_vocabulary_prev_tokens_raise(chat):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        chat.extend([1, 10**9], [{"role": "user", "content": "Hi"}])
