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

Two variants:

- ``causal=False`` (the benchmark's ideal): everything any earlier-sent request computes
  counts, as if each token were computed once (concurrent first turns share the system
  prompt; a scheduler would have to hold the later one back to get this).
- ``causal=True``: only what was computed *when the request arrived*: an earlier
  request's prompt once its first token came back, its answer once it finished.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: its prompt token ids, the token ids it computed after the
    prompt (the generated ones whose KV was written), and, for the causal ideal, when it
    was sent, when its prompt's KV existed (first token) and when it finished."""

    prompt_token_ids: Sequence[int]
    computed_output_token_ids: Sequence[int] = ()
    sent_at: float = 0.0
    prompt_done_at: float = 0.0
    done_at: float = 0.0


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


def ideal_hits(
    requests: Sequence[TraceRequest], block_size: int = 16, causal: bool = False
) -> IdealHits:
    """Ideal cached prompt tokens, per request in the order given (send order). Raises
    ValueError on an empty prompt or a block size below 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for index, request in enumerate(requests):
        if not request.prompt_token_ids:
            raise ValueError(f"request {index} has an empty prompt")
    chains = _BlockChains(block_size)
    # Causal mode: (time the tokens exist, tie-break, tokens), released before each arrival.
    pending: list[tuple[float, int, list[int]]] = []
    per_request = []
    for index, request in enumerate(requests):
        prompt = list(request.prompt_token_ids)
        if causal:
            heapq.heapify(pending)
            while pending and pending[0][0] <= request.sent_at:
                chains.insert(heapq.heappop(pending)[2])
        per_request.append(chains.count_matched(prompt[:-1]) * block_size)
        full = prompt + list(request.computed_output_token_ids)
        if causal:
            pending.append((request.prompt_done_at, 2 * index, prompt))
            pending.append((request.done_at, 2 * index + 1, full))
        else:
            chains.insert(full)
    total = sum(len(r.prompt_token_ids) for r in requests)
    return IdealHits(total, sum(per_request), tuple(per_request))
