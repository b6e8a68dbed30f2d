"""Invariance: what a token computes never depends on what else its step computes.

A prefix cache promises that a hit changes the cost of a turn, not its answer. So for a
token at position p, every value the model computes (each layer's K, V and hidden
state, the logits) is bit-identical whatever the number of rows in its step, its place
in a prefill chunk, the chunk boundaries, whether its prefix came from the cache or
from this request's own prefill, and what else is batched beside it. Each backend keeps
that on its own (the native C kernels, the torch references, Triton), in every dtype:

- every reduction of a row (a linear's sum over its inputs, RMSNorm's sum of squares,
  the attention's dot products, softmax sums and weighted sums of V) runs in an order
  fixed by the row's own length, never by the step's row count or the thread count;
- the attention cuts a query's keys at absolute positions, multiples of
  ``SPAN_TOKENS`` (its spans), walks each span's keys in tiles aligned to position 0,
  and merges the spans' partial states in key order: a decode, a long prefill chunk
  and a one-token extend of the same position run the same operations.

``invariant=False`` (``CHATSVC_INVARIANT=0``) lets each step take the fastest kernels
for its shape instead (docs/kernels.md, "Invariance").
"""

from __future__ import annotations

# Keys per attention span: every path cuts a query's keys at multiples of it (a multiple
# of every key tile the kernels use and of every supported block size, so spans hold
# whole tiles and whole blocks). Long contexts get one piece of work per span, so one
# long decode still keeps every thread busy.
SPAN_TOKENS = 256
