"""The ideal prefix hit rate of a trace: what a cache with unlimited memory could reuse.

Rules (block granularity, like a paged prefix cache):

- Requests are taken in the order they were sent.
- A request may reuse a leading run of its prompt's *full* blocks when each of those
  blocks (with everything before it) was computed by some earlier request.
- The last prompt token is never reused (its logits must be computed), so only full
  blocks inside ``prompt[:-1]`` count::

      prompt  |b0 ..........|b1 ..........|b2 ......  |
                 full            full        partial / holds the last token
      reusable: b0, b1 (if matched) ; never b2

- A request computed its prompt and every generated token but the last one sampled
  (that one's KV is only written when it is fed back), so a later turn can reuse the
  earlier answer up to that token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: its prompt token ids and the token ids it computed after the
    prompt (the generated ones whose KV was written)."""

    prompt_token_ids: Sequence[int]
    computed_output_token_ids: Sequence[int] = ()


@dataclass(frozen=True)
class IdealHits:
    prompt_tokens: int
    cached_tokens: int
    per_request: tuple[int, ...]

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _BlockChains:
    """Exact set of block chains seen so far: chain id of (parent chain id, block tokens).
    Exact tuples instead of hashes, so the ideal can never be inflated by a collision."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def count_matched(self, token_ids: Sequence[int]) -> int:
        parent, matched = -1, 0
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            key = (parent, tuple(token_ids[start : start + self.block_size]))
            if key not in self._ids:
                break
            parent, matched = self._ids[key], matched + 1
        return matched

    def insert(self, token_ids: Sequence[int]) -> None:
        parent = -1
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            key = (parent, tuple(token_ids[start : start + self.block_size]))
            parent = self._ids.setdefault(key, len(self._ids))


def ideal_hits(requests: Sequence[TraceRequest], block_size: int = 16) -> IdealHits:
    """Ideal cached prompt tokens for ``requests`` in send order. Raises ValueError on an
    empty prompt or a block size below 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    chains = _BlockChains(block_size)
    per_request = []
    for index, request in enumerate(requests):
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {index} has an empty prompt")
        matched = chains.count_matched(prompt[:-1])
        per_request.append(matched * block_size)
        chains.insert(prompt + list(request.computed_output_token_ids))
    total = sum(len(r.prompt_token_ids) for r in requests)
    return IdealHits(total, sum(per_request), tuple(per_request))
