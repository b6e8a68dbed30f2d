"""Turn a stream of token ids into a stream of text, and find stop strings in it.

Decoding one token at a time is wrong for byte-level BPE: a character can span
several tokens (UTF-8 bytes split across tokens decode to U+FFFD until the last
byte arrives), and some tokenizers change how a token renders depending on its
left neighbour. So each step decodes a short sliding window twice:

    ids:   ... prompt tail | out_0 ... out_k-1 | out_k (new)
               ^prefix_offset                  ^read_offset
    prefix_text = decode(ids[prefix_offset:read_offset])
    full_text   = decode(ids[prefix_offset:])
    new text    = full_text[len(prefix_text):], released only when it does not
                  end in an incomplete character (U+FFFD); otherwise wait.

Stop strings: released text that could still be the start of a stop string is
withheld until the next tokens resolve it; when a stop string completes, the
text is cut just before it and the sequence ends. ``flush`` releases what is
withheld when the sequence ends for another reason. With ``min_tokens``, stop
strings are searched only once that many tokens are out (as vLLM does); a stop
string that ends in the text of those first tokens does not count.
"""

from __future__ import annotations

from typing import Protocol

# Prompt tokens kept as left context so the first output token renders as it
# would in the middle of the text (e.g. sentencepiece's leading-space rules).
CONTEXT_TOKENS = 5
INCOMPLETE_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Text of one sample's output, released as it becomes final."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        min_tokens: int = 0,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stop = stop
        self._min_tokens = min_tokens
        self._num_tokens = 0
        # Length of the text of the first min_tokens tokens: a stop string counts only
        # when it ends past it.
        self._early_end = 0
        self._max_stop_len = max((len(s) for s in stop), default=0)
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""  # decoded, final text (stop-string cut applied)
        self._released = 0  # chars of _text already handed out
        self.stopped_by: str | None = None  # the stop string that ended the text

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._text[: self._released]

    def add_token(self, token_id: int) -> str:
        """Feed one output token; returns the newly released text (often ``""``).

        After a stop string was found, further tokens are ignored and return ``""``.
        """
        if self.stopped_by is not None:
            return ""
        self._num_tokens += 1
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(INCOMPLETE_CHAR):
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._append(new_text)

    def flush(self) -> str:
        """Release the withheld tail; called when the sample ends without a stop string."""
        tail = self._text[self._released :]
        self._released = len(self._text)
        return tail

    def _append(self, new_text: str) -> str:
        start = len(self._text)
        self._text += new_text
        if not self._stop:
            return self.flush()
        if self._num_tokens < self._min_tokens:
            self._early_end = len(self._text)
        else:
            # A stop string can begin up to max_stop_len - 1 chars before the new text.
            hit = self._find_stop(max(0, start - self._max_stop_len + 1))
            if hit is not None:
                position, stop = hit
                self._text = self._text[:position]
                self.stopped_by = stop
                return self.flush()
        keep = len(self._text) - self._withheld_len()
        released = self._text[self._released : keep]
        self._released = max(self._released, keep)
        return released

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            position = self._text.find(stop, max(search_from, self._early_end - len(stop) + 1))
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _withheld_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)
