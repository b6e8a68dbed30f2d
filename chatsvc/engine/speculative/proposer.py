"""Which sequences speculate, how many tokens they propose, and from where.

``Speculator`` is the one place these decisions are made; the scheduler asks it for a
sequence's proposals (``draft``) and the engine tells it how many were accepted
(``record``). Per sequence it keeps ``SequenceSpeculation``: the n-gram index of the
sequence's context and its ``AdaptiveK``.

Adaptive k: a verification that accepted ``a`` of ``k`` proposals sets the next
``k`` to ``a + 1`` (within ``1..max_k``): text being copied keeps its full run, text
that diverges pays for one wasted row. Two verifications in a row that miss back
off: no proposal for ``cooldown`` steps, doubling up to ``MAX_COOLDOWN`` while it
keeps missing, so a request whose proposals rarely hit decodes one token per step
almost always. A lookup that finds nothing costs the lookup only.

A miss is a verification that kept fewer than ``worth(n) = n / (n + ROW_COST_RATIO)``
of its proposals, ``n`` the sequences decoding in its step. A step costs about a
fixed part (reading the weights) plus a part per row; a proposal costs one row and
brings a token with the probability it is kept, so it pays when that probability
beats a row's share of a decode's cost, ``n c / (W + n c)`` with ``W / c =
ROW_COST_RATIO``. Alone (n = 1) a kept fifth pays; among 8 decodes two thirds must be
kept. ``ROW_COST_RATIO`` is measured on the 2-core Zen 4 EPYC (docs/benchmarks.md,
"Speculative decoding"); a GPU's rows cost far less (a larger ratio).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from chatsvc.engine.speculative.ngram import NgramIndex
from chatsvc.engine.speculative.suffix import TenantOutputs

if TYPE_CHECKING:
    from chatsvc.engine.sequence import Sequence

MIN_N = 2  # a 1-token match proposes noise more often than text
MAX_N = 4
MAX_COOLDOWN = 32  # steps without proposals after repeated misses, at most
MISSES_TO_BACK_OFF = 2
ROW_COST_RATIO = 4.0  # a step's fixed cost over one row's, W / c (module doc)


def worth(num_decoding: int) -> float:
    """The share of its proposals a verification must keep to pay for its rows."""
    return num_decoding / (num_decoding + ROW_COST_RATIO)


class Proposer(Protocol):
    """Guesses up to ``k`` tokens that follow ``seq``'s tokens (fewer or none allowed)."""

    def propose(self, seq: Sequence, k: int) -> list[int]: ...


@dataclass
class AdaptiveK:
    """How many proposals the next verification of one sequence carries (module doc)."""

    max_k: int
    k: int = 0
    misses: int = 0
    cooldown: int = 0  # steps left without proposals
    backoff: int = 1  # the next cooldown's length

    def __post_init__(self) -> None:
        self.k = self.k or self.max_k

    def wanted(self) -> int:
        """Proposals to ask for this step (0 while cooling down; counts the step)."""
        if self.cooldown:
            self.cooldown -= 1
            return 0
        return self.k

    def record(self, proposed: int, accepted: int, needed: float = 0.0) -> None:
        """A verification kept ``accepted`` of ``proposed``; fewer than ``needed`` of them
        (a share) or none is a miss."""
        self.k = max(1, min(self.max_k, accepted + 1))
        if accepted and accepted >= needed * proposed:
            self.misses = 0
            self.backoff = 1
            return
        self.misses += 1
        if self.misses >= MISSES_TO_BACK_OFF:
            self.misses = 0
            self.cooldown = self.backoff
            self.backoff = min(MAX_COOLDOWN, self.backoff * 2)


@dataclass
class SequenceSpeculation:
    """One sequence's speculation state (``Sequence.speculation``)."""

    adaptive: AdaptiveK
    index: NgramIndex = field(default_factory=lambda: NgramIndex(MIN_N, MAX_N))
    needed: float = 0.0  # worth() of the step its last proposals rode in


class Speculator:
    """The engine's speculation: mode, ``max_k``, the tenants' outputs (``suffix``)."""

    def __init__(self, mode: str, max_k: int, max_context_len: int) -> None:
        if mode not in ("ngram", "suffix"):
            raise ValueError(f"speculation mode must be 'ngram' or 'suffix', got {mode!r}")
        self.mode = mode
        self.max_k = max_k
        self.max_context_len = max_context_len
        self.outputs = TenantOutputs(min_n=MIN_N, max_n=MAX_N) if mode == "suffix" else None
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_verifications = 0

    @staticmethod
    def applies_to(seq: Sequence) -> bool:
        """Beam searches pick among whole beams, and prompt logprobs want a prompt's rows:
        neither speculates."""
        params = seq.sampling
        return seq.beams is None and params.prompt_logprobs is None

    def draft(self, seq: Sequence, limit: int, num_decoding: int = 1) -> list[int]:
        """Proposals for ``seq``'s next decode step, at most ``limit`` (the step's spare
        token budget) and never past its ``max_tokens`` or the context;
        ``num_decoding``: the sequences decoding in the step (``worth``)."""
        state = seq.speculation
        if state is None:
            if not self.applies_to(seq):
                return []
            state = seq.speculation = SequenceSpeculation(AdaptiveK(self.max_k))
        room = min(
            limit,
            seq.sampling.max_tokens - len(seq.output_token_ids) - 1,  # the bonus token is one
            self.max_context_len - seq.num_tokens,
        )
        if room < 1:
            return []
        state.needed = worth(num_decoding)
        k = min(state.adaptive.wanted(), room)
        if k < 1:
            return []
        tokens = seq.token_ids()
        proposal = state.index.propose(tokens, k)
        if not proposal and self.outputs is not None:
            proposal = self.outputs.propose(seq.request.namespace.tenant_salt, tokens, k)
        return proposal

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """A verification of ``proposed`` tokens of ``seq`` accepted ``accepted``."""
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.num_verifications += 1
        state = seq.speculation
        if state is not None:
            state.adaptive.record(proposed, accepted, state.needed)

    def finished(self, seq: Sequence) -> None:
        """A sample ended: its output joins its tenant's documents (``suffix``)."""
        if self.outputs is not None and seq.output_token_ids:
            self.outputs.add(seq.request.namespace.tenant_salt, seq.output_token_ids)

    def stats(self) -> dict:
        rate = self.num_accepted / self.num_proposed if self.num_proposed else 0.0
        return {
            "mode": self.mode,
            "proposed_tokens": self.num_proposed,
            "accepted_tokens": self.num_accepted,
            "verifications": self.num_verifications,
            "acceptance_rate": rate,
        }
