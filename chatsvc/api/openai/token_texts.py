"""The text and the exact bytes of single tokens, for logprobs and token counting.

A byte-level BPE token (GPT-2, Llama 3, SmolLM2, Qwen) is stored as a string over a
printable stand-in alphabet, one character per byte, so a token may hold half of a
UTF-8 character: decoding it alone gives U+FFFD, yet its bytes are well defined.
OpenAI's logprobs report both (``token`` and ``bytes``), so clients can glue the
bytes of consecutive tokens back into text. For other tokenizers (SentencePiece)
a token's text is what decoding it alone gives, and its bytes are that text's.
"""

from __future__ import annotations

import functools

from chatsvc.protocol import Tokenizer


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's stand-in character of each byte -> the byte.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space,
    and a few more) are moved, in byte order, to code points from 256 on.
    """
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = [b for b in range(256) if b not in set(kept)]
    alphabet = {chr(b): b for b in kept}
    alphabet.update({chr(256 + i): b for i, b in enumerate(moved)})
    return alphabet


_BYTES_OF = _byte_alphabet()


class TokenTexts:
    """Per-token text and bytes of one tokenizer; results are cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._added = {
            int(i): getattr(t, "content", str(t))
            for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
        }
        self.piece = functools.lru_cache(maxsize=1 << 16)(self._piece)

    def text(self, token_id: int) -> str:
        """The token alone as text (U+FFFD for a part of a character)."""
        return self.piece(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes, exactly (possibly a part of a character)."""
        return list(self.piece(token_id)[1])

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """The tokenizer's own strings of the tokens (e.g. ``Ġthe``), as vLLM's /tokenize."""
        return list(self._tokenizer.convert_ids_to_tokens(list(token_ids)))

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        if token_id in self._added:
            text = self._added[token_id]
            return text, text.encode()
        if self._byte_level:
            raw = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(raw, str) and all(c in _BYTES_OF for c in raw):
                data = bytes(_BYTES_OF[c] for c in raw)
                return data.decode("utf-8", errors="replace"), data
        text = self._tokenizer.decode(
            [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return text, text.encode()


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"
