"""Prompt logprobs: each prompt token's log-probability given the tokens before it.

Prompt token p (p >= 1) is scored by the logits at position p - 1, so a sequence
that asks for them needs logits rows for its prompt positions, not only for its
last new token. Its prefill asks the model for trailing rows of each chunk
(``num_logit_rows``), and ``take_prompt_logprobs`` records them in order in
``seq.prompt_logprobs`` (entry p scores prompt token p; entry 0 is None):

    item: positions s .. e-1 of the sequence (e = s + num_new_tokens), prompt of P
    rows asked:   positions lo .. e-1,  lo = max(s, len(seq.prompt_logprobs) - 1)
    prompt rows:  positions lo .. min(e, P - 1) - 1  -> score tokens lo + 1 ..
    last row:     position e - 1: the one the step keeps for sampling

Such a sequence does not read the prefix cache (the scheduler allocates it
without a match): a cached token's KV is there but its logits are not. Its
blocks are indexed as usual once computed. After a preemption the recompute
skips positions already recorded; once the list is complete the sequence is an
ordinary one (a re-admission reads the cache again).
"""

from __future__ import annotations

from collections.abc import Sequence as Items
from typing import TYPE_CHECKING

import torch

from chatsvc.engine.logprobs import token_logprobs

if TYPE_CHECKING:
    from chatsvc.engine.scheduler_output import ScheduledSequence
    from chatsvc.engine.sequence import Sequence


def wants_prompt_logits(seq: Sequence) -> bool:
    """Whether ``seq`` still needs logits of prompt positions (so must not read the cache)."""
    scores = seq.prompt_logprobs
    return scores is not None and len(scores) < seq.num_prompt_tokens


def _scored_from(item: ScheduledSequence) -> int | None:
    """``lo``: the first position whose logits this step's ``item`` records for its
    prompt (see the module doc), or None when it records none."""
    seq = item.seq
    if not wants_prompt_logits(seq):
        return None
    end = item.start + item.num_new_tokens
    lo = max(item.start, len(seq.prompt_logprobs) - 1)
    return lo if lo < min(end, seq.num_prompt_tokens - 1) else None


def num_logit_rows(item: ScheduledSequence) -> int:
    """Logits rows this step's ``item`` needs: its trailing positions from ``lo`` (see the
    module doc), or ``item.num_rows`` (its last token's; a speculative decode's
    proposals' too: such a sequence never asks for prompt logprobs)."""
    lo = _scored_from(item)
    return item.num_rows if lo is None else item.start + item.num_new_tokens - lo


def take_prompt_logprobs(
    items: Items[ScheduledSequence], logits: torch.Tensor
) -> tuple[torch.Tensor, dict[int, Exception]]:
    """Record the prompt logprobs held in ``logits`` (``num_logit_rows(item)`` rows per
    item, in item order); returns each item's last row (a speculative decode's
    ``num_rows`` rows) and the error of each item (by index) whose rows could not be
    scored.
    """
    counts = [num_logit_rows(item) for item in items]
    if sum(counts) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logits rows for {sum(counts)} asked")
    # By what the rows score, not by their count: a chunk of one prompt token has one
    # row, which is both its prompt score and its last row.
    scoring = [_scored_from(item) is not None for item in items]
    if not any(scoring):
        return logits, {}
    failures: dict[int, Exception] = {}
    last_rows: list[int] = []
    offset = 0
    for index, (item, count) in enumerate(zip(items, counts, strict=True)):
        if scoring[index]:
            try:
                _record(item, logits[offset : offset + count])
            except (ValueError, RuntimeError) as error:
                failures[index] = error
            last_rows.append(offset + count - 1)
        else:
            last_rows.extend(range(offset, offset + count))
        offset += count
    rows = torch.tensor(last_rows, dtype=torch.long, device=logits.device)
    return logits.index_select(0, rows), failures


def _record(item: ScheduledSequence, rows: torch.Tensor) -> None:
    seq = item.seq
    scores = seq.prompt_logprobs
    end = item.start + item.num_new_tokens
    lo = end - rows.shape[0]
    stop = min(end, seq.num_prompt_tokens - 1)  # positions lo .. stop - 1 score a prompt token
    if lo + 1 != len(scores):
        raise RuntimeError(
            f"prompt logprobs of sequence {seq.seq_id}: rows from position {lo}, "
            f"but {len(scores)} tokens are scored"
        )
    prompt_rows = rows[: stop - lo]
    if not bool(torch.isfinite(prompt_rows).all()):
        raise ValueError(f"sequence {seq.seq_id}: the prompt's logits hold NaN or infinity")
    targets = [seq.prompt_token_ids[p + 1] for p in range(lo, stop)]
    scores.extend(token_logprobs(prompt_rows, targets, seq.sampling.prompt_logprobs or 0))
