"""Turning chat messages into prompt tokens with the model's own chat template.

A session's next prompt must start with *exactly* the tokens the model already saw
(its KV is cached under those ids); re-tokenizing the whole history can move token
boundaries and lose the cache. ``extend`` therefore keeps the previous tokens and
tokenizes only the new text, as long as the template renders the old conversation
as a text prefix of the new one. Templates that rewrite history (e.g. dropping
reasoning blocks of earlier turns) get a full re-render instead: correctness first.

Message content is always tokenized as text: only the control tokens the template
itself writes become control token ids (see ``control_tokens``), so no message can
open a turn of another role. A conversation refused for what it holds raises
``RequestValidationError`` (a ValueError): the caller's fault, safe to tell it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from chatsvc.engine.control_tokens import ControlTokens, Rendering
from chatsvc.engine.detokenizer import CONTEXT_TOKENS
from chatsvc.protocol import RequestValidationError
from chatsvc.token_ids import first_bad_token_id

# Marks where the final message's content ends in a rendering (render_continuation):
# invisible separators around a name no text holds by chance.
_CUT_MARK = "\u2063chatsvc-continue-here\u2063"
# End-of-turn markers of common chat templates; those present in a tokenizer's vocabulary
# and used by its template stop generation besides eos.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|eom_id|>")


class ChatFormat:
    """Chat template rendering and token-exact conversation extension for one tokenizer.

    Safe to call from several threads at once: the tokenizer is only read, and the
    encoders are private to this object.
    """

    def __init__(self, tokenizer: Any, extra_stop_token_ids: Iterable[int] = ()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.controls = ControlTokens(tokenizer)
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
        return self._apply_template(messages, add_generation_prompt)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of template text; special tokens come from the text, none are added."""
        return self.controls.encode(text)

    def tokenize_text(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: a control token's spelling stays text."""
        return self.controls.encode_plain(text)

    def render(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the whole conversation (generation prompt appended by default)."""
        rendering = self._render(messages, add_generation_prompt)
        ids = self._token_ids(rendering, 0)
        assert ids is not None  # offset 0 never cuts a control token
        return ids

    def render_continuation(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of the conversation with its final message left open, so that the
        model continues that message (a partial answer given as the last message).

        The template renders the final message closed; the tokens end where its content
        ends, found by rendering it once more with a marker after the content (searching
        for the content itself could land in the template's own text after it). A
        template that rewrites the content (trims it, say) leaves no place to cut:
        refused. An empty final message continues from the turn's opening.
        """
        _validate(messages)
        content = messages[-1]["content"]
        rendering = self._render(messages, add_generation_prompt=False)
        marked = [*messages[:-1], {**messages[-1], "content": content + _CUT_MARK}]
        marked_text = self._apply_template(marked, add_generation_prompt=False)
        end = marked_text.find(_CUT_MARK)
        if (
            end < len(content)
            or marked_text[:end] != rendering.text[:end]
            or not rendering.text[:end].endswith(content)
            or any(s < end < e for s, e, _ in rendering.controls)
        ):
            raise RequestValidationError(
                "the chat template rewrites the final message, so it cannot be continued"
            )
        kept = tuple(c for c in rendering.controls if c[1] <= end)
        ids = self._token_ids(Rendering(rendering.text[:end], kept, rendering.masked), 0)
        assert ids is not None  # offset 0 never cuts a control token
        return ids

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
        renders the previous tokens' text as a prefix of the conversation, with control
        tokens exactly where the template writes them; otherwise
        ``(render(messages), False)``.
        """
        rendering = self._render(messages, add_generation_prompt=True)
        if prev_token_ids:
            _validate_ids(prev_token_ids, len(self.tokenizer))
            prev_text = self.decode(prev_token_ids)
            if rendering.text.startswith(prev_text) and self._same_controls(
                prev_token_ids, rendering, len(prev_text)
            ):
                new = self._token_ids(rendering, len(prev_text))
                if new is not None:
                    return list(prev_token_ids) + new, True
        ids = self._token_ids(rendering, 0)
        assert ids is not None
        return ids, False

    def answer_token_ids(
        self, prompt_token_ids: Sequence[int], token_ids: Sequence[int], text: str
    ) -> list[int]:
        """The token ids to store for a generated answer whose stored text is ``text``.

        The engine's ``token_ids`` can spell more than ``text``: a stop string cuts the
        text but not the token that completed it. Stored ids that decode to more than
        the stored text make the next render stop extending them (no prefix reuse on
        any later turn), so this keeps the longest prefix of ``token_ids`` whose text is
        a prefix of ``text`` (their KV is cached) and tokenizes the rest of ``text`` as
        plain text. A trailing stop token (not part of ``text``) is kept as it was.
        When the ids already decode to ``text`` they are returned unchanged.
        """
        ids = list(token_ids)
        stop = ids[-1:] if ids and ids[-1] in self.stop_token_ids else []
        body = ids[: len(ids) - len(stop)]
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        context_text = self.decode(context)
        target = context_text + text

        def decoded(n: int) -> str:
            return self.decode(context + body[:n])

        full = decoded(len(body))
        if full == target:
            return ids
        common = _common_prefix_len(full, target)
        # Decoded length grows with n (up to a replacement character for a split UTF-8
        # sequence), so bisect to the last prefix that fits the common text, then step
        # back to one whose text really is a prefix of the target.
        lo, hi = 0, len(body)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(decoded(mid)) <= common:
                lo = mid
            else:
                hi = mid - 1
        keep = lo
        while keep > 0 and not _is_prefix_of(decoded(keep), target, len(context_text)):
            keep -= 1
        kept_text = decoded(keep)[len(context_text) :] if keep else ""
        return body[:keep] + self.tokenize_text(text[len(kept_text) :]) + stop

    def _apply_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool
    ) -> str:
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def _render(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool
    ) -> Rendering:
        _validate(messages)
        mask = self.controls.mask([m["content"] for m in messages], self.tokenizer.chat_template)
        if mask is None:
            text = self._apply_template(messages, add_generation_prompt)
            return Rendering(text, self.controls.find(text), masked=False)
        hidden = [{**m, "content": c} for m, c in zip(messages, mask.contents, strict=True)]
        masked_text = self._apply_template(hidden, add_generation_prompt)
        # Unmask the text between the template's control tokens, tracking where each
        # control token lands in the real text.
        pieces: list[str] = []
        controls: list[tuple[int, int, int]] = []
        length = position = 0
        for start, end, token_id in self.controls.find(masked_text):
            piece = mask.unmask(masked_text[position:start])
            length += len(piece)
            controls.append((length, length + end - start, token_id))
            pieces += [piece, masked_text[start:end]]
            length += end - start
            position = end
        pieces.append(mask.unmask(masked_text[position:]))
        text = "".join(pieces)
        # A template that inspects or slices content could render the masked messages
        # differently; then the text would not be the template's own rendering.
        if text != self._apply_template(messages, add_generation_prompt):
            raise RequestValidationError(
                "a message spells a control token of this model's chat template in a way "
                "the template cannot render as plain text"
            )
        return Rendering(text, tuple(controls), masked=True)

    def _token_ids(self, rendering: Rendering, start: int) -> list[int] | None:
        """Token ids of ``rendering.text[start:]``; None when ``start`` cuts a control token."""
        if any(s < start < e for s, e, _ in rendering.controls):
            return None
        if not rendering.masked:
            # No content spells a control token, so parsing the text finds exactly the
            # template's: the ids are those of the plain tokenizer call.
            return self.tokenize(rendering.text[start:])
        pieces: list[str | int] = []
        position = start
        for s, e, token_id in rendering.controls:
            if s < start:
                continue
            pieces += [rendering.text[position:s], token_id]
            position = e
        pieces.append(rendering.text[position:])
        return self.controls.encode_pieces(pieces)

    def _same_controls(self, prev_token_ids: Sequence[int], rendering: Rendering, end: int) -> bool:
        """Whether the previous tokens hold exactly the template's control tokens before ``end``.

        Text alone cannot tell a control token from its spelling; a history stored
        when content was parsed for control tokens holds more of them than the
        template wrote and must be rendered again.
        """
        held = [t for t in prev_token_ids if t in self.controls.id_set]
        written = [token_id for s, _, token_id in rendering.controls if s < end]
        return held == written


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _is_prefix_of(decoded: str, target: str, context_len: int) -> bool:
    return len(decoded) >= context_len and target.startswith(decoded)


def _validate(messages: Sequence[Mapping[str, str]]) -> None:
    if isinstance(messages, (str, bytes)) or not messages:
        raise RequestValidationError(
            "messages must be a non-empty list of {'role', 'content'} mappings"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RequestValidationError(f"message {i} is not a mapping: {message!r}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise RequestValidationError(f"message {i} needs a non-empty string 'role'")
        if not isinstance(content, str):
            raise RequestValidationError(f"message {i} needs a string 'content'")


def _validate_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    bad = first_bad_token_id(token_ids, vocab_size)
    if bad is not None:
        raise RequestValidationError(
            f"token id {bad.value!r} is outside the vocabulary (size {vocab_size})"
        )
