"""Turning chat messages into prompt tokens with the model's own chat template.

A session's next prompt must start with *exactly* the tokens the model already saw
(its KV is cached under those ids); re-tokenizing the whole history can move token
boundaries and lose the cache. ``extend`` therefore keeps the previous tokens and
tokenizes only the new text, as long as the template renders the old conversation
as a text prefix of the new one. Templates that rewrite history (e.g. dropping
reasoning blocks of earlier turns) get a full re-render instead: correctness first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# End-of-turn markers of common chat templates; those present in a tokenizer's vocabulary
# and used by its template stop generation besides eos.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>")


class ChatFormat:
    """Chat template rendering and token-exact conversation extension for one tokenizer."""

    def __init__(self, tokenizer: Any, extra_stop_token_ids: Iterable[int] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.stop_token_ids: tuple[int, ...] = self._find_stop_ids(extra_stop_token_ids)

    def _find_stop_ids(self, extra: Iterable[int]) -> tuple[int, ...]:
        ids: list[int] = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        vocab = self.tokenizer.get_vocab()
        template = self.tokenizer.chat_template
        ids.extend(vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab and t in template)
        ids.extend(int(i) for i in extra)
        return tuple(dict.fromkeys(ids))  # unique, first occurrence order

    def render_text(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The whole conversation as the template's text."""
        _validate(messages)
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of template text; special tokens come from the text, none are added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the whole conversation (generation prompt appended by default)."""
        return self.tokenize(self.render_text(messages, add_generation_prompt))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids with special tokens kept, exactly as the template wrote them."""
        return self.tokenizer.decode(
            list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def extend(
        self, prev_token_ids: Sequence[int], messages: Sequence[Mapping[str, str]]
    ) -> tuple[list[int], bool]:
        """The prompt for ``messages`` (the whole conversation, new turn included).

        Returns ``(prev_token_ids + tokens of the new text, True)`` when the template
        renders the previous tokens' text as a prefix of the conversation; otherwise
        ``(render(messages), False)``.
        """
        text = self.render_text(messages)
        if not prev_token_ids:
            return self.tokenize(text), False
        _validate_ids(prev_token_ids, len(self.tokenizer))
        prev_text = self.decode(prev_token_ids)
        if not text.startswith(prev_text):
            return self.tokenize(text), False
        return list(prev_token_ids) + self.tokenize(text[len(prev_text) :]), True


def _validate(messages: Sequence[Mapping[str, str]]) -> None:
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} mappings")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} is not a mapping: {message!r}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i} needs a non-empty string 'role'")
        if not isinstance(content, str):
            raise ValueError(f"message {i} needs a string 'content'")


def _validate_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    for tid in token_ids:
        if not isinstance(tid, int) or not 0 <= tid < vocab_size:
            raise ValueError(f"token id {tid!r} is outside the vocabulary (size {vocab_size})")
