"""Verification of one speculative decode: which proposals the request keeps.

Row i of the step's logits is the distribution of the token after the newest token
and proposals ``0 .. i-1``. Going down the rows, each picks its token exactly as a
one-token decode would: the request's logit processing (penalties see the tokens
accepted before the row), temperature and filters, the argmax or one uniform number
from the request's generator. Proposal i is accepted when row i picks it; the first
row that picks something else ends the run with that token, and when every proposal
is accepted the last row adds one more (the bonus token).

Greedy: the rows' logits are bit-identical to one-token decodes' (invariance), so the
tokens are the ones decoding without speculation gives.

Sampled: for a deterministic draft (the proposal ``x`` has probability 1 under the
proposer), standard speculative rejection sampling accepts ``x`` with probability
``min(1, p(x) / 1) = p(x)`` and on rejection draws from ``max(0, p - 1[x])``
normalised: ``p`` without ``x``, renormalised. Drawing ``y ~ p`` and accepting iff
``y == x`` is that same distribution (P(accept) = p(x); given a rejection, ``y`` is
``p`` restricted to ``y != x``), and draws one uniform per emitted token as decoding
does, so a seeded request's output is the same with speculation on and off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def verify_draft(
    rows: torch.Tensor,
    draft: Sequence[int],
    pick: Callable[[torch.Tensor], int],
    emit: Callable[[int], bool],
) -> int:
    """Emit the tokens of one speculative decode; returns how many proposals were kept.

    ``rows [len(draft) + 1, V]``; ``pick(row)`` chooses a row's token (raising when it
    cannot); ``emit(token)`` appends it to the request and returns True when the
    request ends there (a stop, ``max_tokens``), which ends the run too.
    """
    if rows.dim() != 2 or rows.shape[0] != len(draft) + 1:
        raise ValueError(f"{len(draft)} proposals need {len(draft) + 1} rows, got {rows.shape}")
    accepted = 0
    for i in range(len(draft) + 1):
        token = pick(rows[i])
        ended = emit(token)
        if i == len(draft) or token != draft[i]:
            return accepted
        accepted += 1
        if ended:
            return accepted
    return accepted
