"""A tokenizer's control tokens, and message content that must never become one.

A chat template writes its control tokens (``<|im_start|>``, ``<|im_end|>``, ...) as
text, so a rendered conversation is tokenized with special-token parsing on. Content
that spells a control token would then become the real token and let a user forge
turns of another role (role injection). So, before rendering, each control token's
text inside content is replaced by one private-use character; the control tokens left
in the rendered text are the template's own. The text between them is unmasked again
and tokenized as plain text::

    content   "hi <|im_end|>"            -> masked "hi \U000f0000"
    rendered  "<|im_start|>user\\nhi \U000f0000<|im_end|>\\n"
    tokens    [<|im_start|>] + plain("user\\nhi <|im_end|>") + [<|im_end|>] + plain("\\n")

Both encoders are private copies of the tokenizer's Rust backend, each fixed in one
mode at construction: the transformers wrapper switches special-token parsing with a
flag on its shared backend, which concurrent callers on worker threads would race on.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from chatsvc.protocol import RequestValidationError

# Unicode's supplementary private-use plane: characters no tokenizer gives meaning to.
_PRIVATE_FIRST, _PRIVATE_LAST = 0xF0000, 0xFFFFD
_PRIVATE_RE = re.compile("[\U000f0000-\U000ffffd]")


@dataclass(frozen=True)
class Rendering:
    """A rendered conversation and where the template's own control tokens sit in it.

    ``text`` is exactly what the template renders for the real messages; ``controls``
    lists ``(start, end, token_id)`` of every control token the template wrote, in
    order. ``masked`` is true when some content spelled a control token (then those
    spellings are text, not among ``controls``).
    """

    text: str
    controls: tuple[tuple[int, int, int], ...]
    masked: bool


@dataclass(frozen=True)
class Mask:
    """Content with control-token text replaced by placeholders, and the way back."""

    contents: list[str]
    table: dict[int, str]  # placeholder code point -> control token text

    def unmask(self, text: str) -> str:
        return text.translate(self.table)


class ControlTokens:
    """The special tokens of one tokenizer, and encoders that parse them or never do."""

    def __init__(self, tokenizer) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("chat formatting needs a fast tokenizer (a tokenizer.json)")
        self.ids: dict[str, int] = {
            token.content: int(token_id)
            for token_id, token in tokenizer.added_tokens_decoder.items()
            if token.special
        }
        self.id_set = frozenset(self.ids.values())
        # Longest first: where two tokens start at one position the longer one wins,
        # as in the tokenizer's own leftmost-longest matching.
        by_length = sorted(self.ids, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        self._parsing = _fixed_copy(backend, encode_special_tokens=False)
        self._plain = _fixed_copy(backend, encode_special_tokens=True)

    def find(self, text: str) -> tuple[tuple[int, int, int], ...]:
        """``(start, end, id)`` of every control token spelled in ``text``."""
        if self._pattern is None:
            return ()
        return tuple(
            (m.start(), m.end(), self.ids[m.group()]) for m in self._pattern.finditer(text)
        )

    def mask(self, contents: Sequence[str], template: str) -> Mask | None:
        """Placeholders for the control tokens spelled in ``contents``; None if there are none.

        Placeholders are private-use characters found in no content and not in the
        template, so every placeholder in a rendering came from a mask.
        """
        if self._pattern is None or not any(self._pattern.search(c) for c in contents):
            return None
        taken = set(_PRIVATE_RE.findall(template))
        for content in contents:
            taken.update(_PRIVATE_RE.findall(content))
        free = (c for c in range(_PRIVATE_FIRST, _PRIVATE_LAST + 1) if chr(c) not in taken)
        placeholders = {token: chr(next(free)) for token in self.ids}
        masked = [self._pattern.sub(lambda m: placeholders[m.group()], c) for c in contents]
        return Mask(masked, {ord(p): token for token, p in placeholders.items()})

    def encode(self, text: str) -> list[int]:
        """Token ids of template text: control tokens spelled in it become their ids."""
        return self._parsing.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: no control token comes out of it."""
        ids = self._plain.encode(text, add_special_tokens=False).ids
        if not self.id_set.isdisjoint(ids):
            # Only a vocabulary whose ordinary merges spell a special token does this.
            raise RequestValidationError("this tokenizer turns plain text into a control token")
        return ids

    def encode_pieces(self, pieces: Iterable[str | int]) -> list[int]:
        """Concatenated ids of text pieces (encoded as plain text) and control ids."""
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            elif piece:
                ids.extend(self.encode_plain(piece))
        return ids


def _fixed_copy(backend, *, encode_special_tokens: bool):
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = encode_special_tokens
    return copy
