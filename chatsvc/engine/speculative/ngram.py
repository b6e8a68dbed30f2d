"""N-gram prompt lookup over one token list: the continuation of the longest recent
suffix's last earlier occurrence.

    tokens   ... a b c d x y z ... a b c d |      (| = the end, suffix "a b c d")
    proposal              x y z ...               (what followed its last earlier occurrence)

``NgramIndex`` maps every n-gram (``min_n <= n <= max_n``) of the list to the position
right after its last occurrence, and is kept up to date as tokens are appended (a few
dict writes per token), so a lookup costs ``max_n - min_n + 1`` dict reads however
long the context is. Invariant: ``last_after[n][gram] = e + 1`` for the largest ``e <
num_indexed`` where ``gram`` ends at ``e``; only n-grams ending before the list's last
token are indexed at lookup time, so the suffix never finds itself.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Last occurrences of the n-grams of a growing token list (see the module doc)."""

    __slots__ = ("min_n", "max_n", "last_after", "num_indexed")

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.last_after: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)
        }
        self.num_indexed = 0  # n-grams ending at positions < num_indexed are indexed

    def index_until(self, tokens: Sequence[int], end: int) -> None:
        """Index the n-grams ending at positions ``[num_indexed, end)``."""
        for e in range(self.num_indexed, end):
            for n, table in self.last_after.items():
                if e + 1 >= n:
                    table[tuple(tokens[e + 1 - n : e + 1])] = e + 1
        self.num_indexed = max(self.num_indexed, end)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens following the last earlier occurrence of the longest suffix
        of ``tokens`` (of ``max_n`` down to ``min_n`` tokens) that occurred before."""
        length = len(tokens)
        if k < 1 or length < self.min_n + 1:
            return []
        self.index_until(tokens, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            after = self.last_after[n].get(tuple(tokens[length - n :]))
            if after is not None:
                return list(tokens[after : min(after + k, length)])
        return []
