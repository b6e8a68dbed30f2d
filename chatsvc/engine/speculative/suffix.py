"""Earlier outputs of each tenant, looked up by the n-grams a sequence ends with.

``ngram`` finds text already in the request's own context (its prompt holds the
session's history). This store adds what the tenant's earlier requests generated but
the request does not quote: another session's answer to the same question, a rewrite
of an answer that left the context, an agent's earlier tool call. Each finished
sample's output is a document; the store maps each n-gram (``min_n..max_n``) of the
tenant's documents to (document, position right after its last occurrence).

Keyed by the tenant's cache salt, so a proposal never comes from another tenant's
text (a proposal changes no output, but how fast a request runs must not tell one
tenant what another wrote). Bounded: at most ``max_tokens`` tokens over all tenants;
the least recently added documents go first, their n-grams with them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class TenantOutputs:
    """Documents (output token lists) per tenant with an n-gram index; LRU-bounded."""

    def __init__(self, max_tokens: int = 1 << 20, min_n: int = 2, max_n: int = 4) -> None:
        if max_tokens < 1 or not 1 <= min_n <= max_n:
            raise ValueError("need max_tokens >= 1 and 1 <= min_n <= max_n")
        self.max_tokens = max_tokens
        self.min_n = min_n
        self.max_n = max_n
        self.num_tokens = 0
        self._next_id = 0
        # (tenant, doc id) -> tokens, oldest first.
        self._docs: OrderedDict[tuple[bytes, int], list[int]] = OrderedDict()
        # tenant -> n-gram -> (doc id, position after its last occurrence in that doc).
        self._grams: dict[bytes, dict[tuple[int, ...], tuple[int, int]]] = {}

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, tenant: bytes, tokens: Sequence[int]) -> None:
        """Record one finished output of ``tenant`` (too short to hold an n-gram: ignored)."""
        tokens = list(tokens)
        if len(tokens) <= self.min_n or len(tokens) > self.max_tokens:
            return
        doc = self._next_id
        self._next_id += 1
        self._docs[(tenant, doc)] = tokens
        self.num_tokens += len(tokens)
        grams = self._grams.setdefault(tenant, {})
        for key, after in self._grams_of(tokens):
            grams[key] = (doc, after)
        while self.num_tokens > self.max_tokens:
            self._evict_oldest()

    def propose(self, tenant: bytes, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix of ``context`` (``max_n``
        down to ``min_n`` tokens) in the tenant's most recent document holding it."""
        grams = self._grams.get(tenant)
        if not grams or k < 1:
            return []
        length = len(context)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            hit = grams.get(tuple(context[length - n :]))
            if hit is not None:
                doc, after = hit
                tokens = self._docs[(tenant, doc)]
                return tokens[after : after + k]
        return []

    def _evict_oldest(self) -> None:
        (tenant, doc), tokens = self._docs.popitem(last=False)
        self.num_tokens -= len(tokens)
        grams = self._grams[tenant]
        for key, _ in self._grams_of(tokens):
            hit = grams.get(key)
            if hit is not None and hit[0] == doc:
                del grams[key]
        if not grams:
            del self._grams[tenant]

    def _grams_of(self, tokens: list[int]):
        """(n-gram, the position right after it) for every n-gram of a document, in
        order; none ends at the last token (it would propose nothing)."""
        for e in range(len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, e + 1) + 1):
                yield tuple(tokens[e + 1 - n : e + 1]), e + 1
