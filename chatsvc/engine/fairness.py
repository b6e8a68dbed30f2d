"""Fair admission between tenants: whose waiting sequence joins the batch next.

One tenant's long queue must not keep another tenant out. The scheduler ranks
its waiting sequences as before (preempted, aged, longest cached prefix);
``FairQueue`` then hands them out tenant by tenant: the next candidate is the
first one of the tenant that holds the fewest sequence slots. A tenant is thus
admitted while another one waits only if it holds no more slots than that one,
and a lone tenant still gets every slot (nothing is held back).

A slot is one running sequence; a request with ``n`` samples holds ``n`` from its
admission on, because its children fork from it once its prompt is computed.

Fair slots are not enough for latency: a step costs about its token count, and
one tenant's 64 decodes plus a full prefill chunk make every other tenant's next
token wait for all of it. ``StepShares`` therefore splits the step's token
budget evenly between the tenants that have work in it: with two tenants each
may put at most half of ``max_num_batched_tokens`` into the step (its decodes
included), so another tenant's inter-token gap is bounded by the cost of half a
step whatever the first one sends. A lone tenant gets the whole budget, so a
quiet server loses nothing; a tenant that uses less than its share leaves the
rest unused rather than handing it on (that is the bound).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from chatsvc.engine.prompt_logprobs import wants_prompt_logits
from chatsvc.engine.sequence import Sequence


def tenant_of(seq: Sequence) -> str:
    """Whose sequence this is: the request's tenant label, else its cache namespace's
    label (both are the tenant id where the API builds requests)."""
    return seq.request.labels.get("tenant") or seq.request.namespace.label


def slots_of(seq: Sequence) -> int:
    """Sequence slots ``seq`` takes: a first sample whose prompt is not computed yet
    will fork into ``n`` samples (a beam search's root into ``beam_width`` beams), so
    it counts as all of them."""
    if seq.sample_index == 0 and not seq.output_token_ids:
        return max(seq.request.sampling.n, seq.request.sampling.beam_width)
    return 1


class FairQueue:
    """One step's admission candidates, grouped by tenant and handed out fairly.

    ``candidates`` are (sequence, may_defer) in the scheduler's order, which is kept
    within each tenant. ``pop`` removes and returns the next candidate; ``admit``
    charges its tenant once it joined the running sequences (a deferred or refused
    candidate is not charged).
    """

    def __init__(
        self, candidates: Iterable[tuple[Sequence, bool]], running: Iterable[Sequence]
    ) -> None:
        self.loads: dict[str, int] = {}
        for seq in running:
            tenant = tenant_of(seq)
            self.loads[tenant] = self.loads.get(tenant, 0) + slots_of(seq)
        self.num_slots = sum(self.loads.values())
        # tenant -> its candidates as (position in the scheduler's order, seq, may_defer)
        self._queues: dict[str, deque[tuple[int, Sequence, bool]]] = {}
        for position, (seq, may_defer) in enumerate(candidates):
            self._queues.setdefault(tenant_of(seq), deque()).append((position, seq, may_defer))

    def __bool__(self) -> bool:
        return bool(self._queues)

    def pop(self) -> tuple[Sequence, bool]:
        """The next candidate: of the tenant holding the fewest slots; on a tie, of the
        tenant whose candidate comes first in the scheduler's order."""
        queues = self._queues
        tenant = min(queues, key=lambda t: (self.loads.get(t, 0), queues[t][0][0]))
        _, seq, may_defer = queues[tenant].popleft()
        if not queues[tenant]:
            del queues[tenant]
        return seq, may_defer

    def drop_tenant(self, seq: Sequence) -> None:
        """No more candidates of ``seq``'s tenant this step (its share is spent)."""
        self._queues.pop(tenant_of(seq), None)

    def admit(self, seq: Sequence) -> None:
        """Charge ``seq``'s tenant for the slots it now holds."""
        tenant = tenant_of(seq)
        cost = slots_of(seq)
        self.loads[tenant] = self.loads.get(tenant, 0) + cost
        self.num_slots += cost


# What a sequence's context costs in a step, in tokens (a token: one row through the
# linears). Each row attends over the context (compute: one token per CONTEXT_PER_ROW
# context tokens), and each sequence reads its context's K/V once per step (memory:
# one token per CONTEXT_PER_READ). Where the constants come from: docs/engine.md,
# "Step shares count context".
CONTEXT_PER_ROW = 4096
CONTEXT_PER_READ = 512
# What a logits row costs on top of its token: the LM head over the whole vocabulary,
# then the sampling of a generating sequence (or the log-softmax and top-k that score
# a prompt position: prompt logprobs, echo with logprobs), about one more token's work
# (docs/engine.md, "Step shares count context"). Every sequence in a step computes at
# least one such row; a sequence scoring its prompt one per position.
COST_PER_LOGIT_ROW = 1


def step_cost(tokens: int, context: int, logit_rows: int = 0) -> int:
    """Cost in tokens of computing ``tokens`` new tokens of a sequence whose KV then
    spans ``context`` tokens (this step's included), ``logit_rows`` logits rows among them
    (``COST_PER_LOGIT_ROW`` each)."""
    return (
        tokens
        + tokens * context // CONTEXT_PER_ROW
        + context // CONTEXT_PER_READ
        + logit_rows * COST_PER_LOGIT_ROW
    )


class StepShares:
    """Cost each tenant may still put into the step being planned.

    ``tenants`` are those with work in it; each gets ``budget // len(tenants)``.
    With two tenants or more a sequence's work is counted by ``step_cost``, not by
    its tokens alone: a step's time grows with the context its sequences attend
    over, and a tenant's long-context decodes would otherwise make the step long
    whatever its token count. A tenant's first sequence in a step always gets a
    token, so nobody stalls. A lone tenant, or ``shared=False``, gets the whole
    budget in plain tokens (the step's own token budget still applies).
    """

    def __init__(self, budget: int, tenants: set[str], shared: bool = True) -> None:
        self.by_cost = shared and len(tenants) > 1
        self.share = max(1, budget // len(tenants)) if shared and tenants else budget
        self.used: dict[str, int] = {}

    def left(self, seq: Sequence) -> int:
        return self.share - self.used.get(tenant_of(seq), 0)

    def fit(self, seq: Sequence, wanted: int) -> int:
        """How many of ``wanted`` next tokens of ``seq`` its tenant's share still holds."""
        left = self.left(seq)
        if not self.by_cost:
            return max(0, min(wanted, left))
        if tenant_of(seq) not in self.used:
            left = max(left, self._cost(seq, 1))  # the tenant's first token of the step
        low, high = 0, wanted  # the most tokens whose cost fits: cost grows with tokens
        while low < high:
            mid = (low + high + 1) // 2
            if self._cost(seq, mid) <= left:
                low = mid
            else:
                high = mid - 1
        return low

    def fits_all(self, seqs: list[Sequence]) -> bool:
        """Whether one token of each of ``seqs`` (one tenant's: a beam search's beams,
        which go together or not at all) fits the tenant's share. The tenant's first
        work in the step always does, so a search wider than a share still runs."""
        tenant = tenant_of(seqs[0])
        if tenant not in self.used:
            return True
        cost = sum(self._cost(seq, 1) for seq in seqs) if self.by_cost else len(seqs)
        return cost <= self.left(seqs[0])

    def spend(self, seq: Sequence, tokens: int) -> None:
        tenant = tenant_of(seq)
        cost = self._cost(seq, tokens) if self.by_cost else tokens
        self.used[tenant] = self.used.get(tenant, 0) + cost

    @staticmethod
    def _cost(seq: Sequence, tokens: int) -> int:
        # A sequence scoring its prompt needs a logits row per position (all but the
        # last prompt token's, which it samples from anyway: close enough to count all);
        # any other sequence one, its last token's.
        rows = tokens if wants_prompt_logits(seq) else min(tokens, 1)
        return step_cost(tokens, seq.num_computed_tokens + tokens, rows)
