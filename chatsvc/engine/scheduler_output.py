"""What one scheduler step hands the engine: the sequences to run and what changed.

Its own module because the scheduler, the runner and prompt logprobs all read
a ``ScheduledSequence``, and the scheduler itself asks prompt logprobs which
sequences must skip the prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cache import CachePlan
from chatsvc.engine.sequence import Sequence
from chatsvc.engine.step_io import SequenceLoads


@dataclass
class ScheduledSequence:
    """``num_new_tokens`` tokens of ``seq`` from position ``start`` on.

    ``completes``: after this step every token has KV, so the last token's logits
    give the next token (false for intermediate prefill chunks: no sampling).

    ``draft``: a speculative decode (``chatsvc.engine.speculative``): the newest token
    and these proposals, which are not the sequence's tokens (yet), are the step's
    ``1 + len(draft)`` new tokens, and each has a logits row (``num_rows``).
    """

    seq: Sequence
    num_new_tokens: int
    slots: list[int]
    draft: tuple[int, ...] = ()
    start: int = 0
    completes: bool = False

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.completes = self.start + self.num_new_tokens == self.seq.num_tokens + len(self.draft)

    @property
    def num_rows(self) -> int:
        """Logits rows the item keeps for sampling: its last token's, and one per proposal."""
        return 1 + len(self.draft)

    def token_at(self, position: int) -> int:
        """The token at ``position``: the sequence's, or a proposal past its end."""
        seq = self.seq
        if position < seq.num_tokens:
            return seq.token_at(position)
        return self.draft[position - seq.num_tokens]


@dataclass
class SchedulerOutput:
    """One step: what to run, the cache plans to execute before it (in order), what changed."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    plans: list[CachePlan] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)
    loads: list[SequenceLoads] = field(default_factory=list)  # for StepIO.submit

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


def keep_rows(
    items: list[ScheduledSequence],
    logits: torch.Tensor,
    keep: Callable[[ScheduledSequence], bool],
) -> tuple[list[ScheduledSequence], torch.Tensor]:
    """The items ``keep`` holds and their rows of ``logits``, which has ``item.num_rows``
    rows per item in item order (one unless the item is a speculative decode)."""
    kept: list[ScheduledSequence] = []
    rows: list[int] = []
    offset = 0
    for item in items:
        if keep(item):
            kept.append(item)
            rows.extend(range(offset, offset + item.num_rows))
        offset += item.num_rows
    if len(rows) < logits.shape[0]:
        logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
    return kept, logits
