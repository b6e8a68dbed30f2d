"""Per-request logit processing: logit_bias, min_tokens, repetition/frequency/presence penalties.

Each sequence that asks for any of these owns a ``LogitsState``. It keeps what the
penalties need as the sequence grows, one token at a time, never rebuilt from the
token list:

    seen    [V] bool    prompt + output tokens        (repetition_penalty)
    counts  [V] int32   occurrences in the output      (frequency/presence_penalty)

and applies itself to its own row of a step's logits, in vLLM's order:

    row += logit_bias
    row[stop ids] = -inf               while fewer than min_tokens are out
    row = row / rp  where seen and row > 0,  row * rp  where seen and row <= 0
    row -= frequency_penalty * counts + presence_penalty * (counts > 0)

Only that row is written, so what one request asks for never reaches another
request's logits in the same batch. Temperature and the filters (top-k, min-p,
top-p) come after, in ``sampling``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from chatsvc.protocol import SamplingParams


class LogitsState:
    """What one sequence's logit processing needs, kept incrementally; see the module doc."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        vocab_size: int,
        stop_token_ids: Iterable[int],
        device: torch.device | str = "cpu",
    ) -> None:
        self.params = params
        self.num_output_tokens = 0
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            self.bias_ids = torch.tensor(ids, dtype=torch.long, device=device)
            self.bias_values = torch.tensor(values, dtype=torch.float32, device=device)
        self.min_tokens_mask: torch.Tensor | None = None
        stops = sorted(set(stop_token_ids))
        if params.min_tokens and stops:
            self.min_tokens_mask = torch.tensor(stops, dtype=torch.long, device=device)
        self.seen: torch.Tensor | None = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if prompt_token_ids:
                prompt = torch.tensor(list(prompt_token_ids), dtype=torch.long, device=device)
                self.seen[prompt] = True
        self.counts: torch.Tensor | None = None
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)

    @staticmethod
    def is_needed(params: SamplingParams) -> bool:
        """Whether ``params`` ask for any processing (otherwise the row stays as it is)."""
        return bool(params.logit_bias) or params.min_tokens > 0 or params.has_penalties

    def add_token(self, token_id: int) -> None:
        """Record a new output token (O(1): one element of each tensor)."""
        self.num_output_tokens += 1
        if self.seen is not None:
            self.seen[token_id] = True
        if self.counts is not None:
            self.counts[token_id] += 1

    def apply_(self, row: torch.Tensor) -> None:
        """Process one row ``[V]`` (fp32) in place; the row must belong to this sequence alone."""
        p = self.params
        if self.bias_ids is not None:
            row.index_add_(0, self.bias_ids, self.bias_values)
        if self.min_tokens_mask is not None and self.num_output_tokens < p.min_tokens:
            row.index_fill_(0, self.min_tokens_mask, float("-inf"))
        if self.seen is not None:
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(self.seen, penalised, row))
        if self.counts is not None:
            counts = self.counts.to(row.dtype)
            row.sub_(counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty)
