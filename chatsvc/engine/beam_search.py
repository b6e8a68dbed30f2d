"""Beam search: one request's beams, its finished hypotheses, and the step that picks them.

The semantics are transformers' ``generate(num_beams=W, do_sample=False)`` (its
``_beam_search``, 5.x), computed the same way in fp32, so an answer moved from it
is the same answer:

- A beam's score is the sum of the raw model's log-probabilities of its tokens
  (log-softmax of the logits; before ``min_tokens`` output tokens the stop tokens'
  are -inf, as ``min_new_tokens`` does there).
- Each step ranks the continuations of every running beam together ([beams x
  vocab] flattened) and keeps the top ``K = max(2, 1 + number of stop tokens) * W``.
  A continuation that ends (a stop token, or ``max_new_tokens`` reached) becomes a
  finished hypothesis only if it ranks among the first W of the K; its score is
  ``sum / generated_len ** length_penalty`` (the stop token counts in the length),
  and the best W hypotheses are kept. The W best continuations that do not end
  are the next running beams.
- The search ends when every continuation ends (``max_new_tokens``), or once W
  hypotheses are finished and: ``early_stopping`` True; False (the default): the
  best running beam, scored at its current length, cannot beat the worst of them;
  "never": the same, but with a positive length penalty scored at
  ``max_new_tokens``, the longest it could become.
- The answer is the finished hypotheses, best first; a request returns ``n``.

The first step runs on the prompt's one row: transformers starts W copies of the
prompt with every beam but the first at -1e9, so its first candidates all come
from one row too.

On the block table (``advance``): a parent's first continuation takes its
sequence over; each further one forks it (``cache.fork``: every block shared,
the partial last one copied on its first write), and a parent with none is
dropped at once, its blocks freed. Beams index none of their generated blocks
(``cache.stop_indexing``), so a dropped beam's blocks go straight back to the
free list.

    step t:   beams  A      B      C      D        (each: prompt blocks shared, own tail)
    select:   picks  A+x    A+y    C+z    B+w
    advance:  A keeps its sequence (+x), a fork of A (+y), C (+z), B (+w); D freed
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from chatsvc.engine.sequence import Sequence, SequenceStatus
from chatsvc.protocol import FinishReason, SamplingParams


def peak_blocks(num_prompt: int, longest: int, width: int, block_size: int) -> int:
    """The most device blocks a beam search over ``num_prompt`` prompt tokens, growing
    to ``longest`` tokens, can hold: the prompt's full blocks once, and each beam's
    own blocks at full length (its copy of the prompt's partial block included). At
    most the prompt's blocks + ``width`` x the answer's + ``width``. The scheduler
    admits the root with one block per beam on top of the prompt's, so that too."""
    shared = num_prompt // block_size
    peak = shared + width * (-(-longest // block_size) - shared)
    return max(peak, -(-num_prompt // block_size) + width)


class Hypothesis(NamedTuple):
    """A finished beam: its generated tokens (a stop token last when ``finish_reason`` is
    "stop") and its score, ``sum of log-probabilities / len(token_ids) ** length_penalty``."""

    token_ids: tuple[int, ...]
    score: float
    finish_reason: FinishReason


class BeamSearchError(RuntimeError):
    """A step's logits cannot be ranked (NaN or infinity): the request fails alone."""


class BeamSearch:
    """Per-request state: the running beams (best first), their scores, the hypotheses.

    ``beams[i]`` is a running engine sequence whose newest token is the one ``select``
    picked for it; ``scores[i]`` (fp32) is the sum of its tokens' log-probabilities.
    Every beam has the same number of output tokens. ``finished`` holds at most
    ``width`` hypotheses, best first.
    """

    def __init__(
        self,
        root: Sequence,
        params: SamplingParams,
        stop_token_ids: frozenset[int],
        max_new_tokens: int,
    ) -> None:
        self.width = params.beam_width
        self.num_results = params.n
        self.length_penalty = float(params.length_penalty)
        self.early_stopping = params.early_stopping
        self.min_tokens = params.min_tokens
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_token_ids
        self._stop_index = torch.tensor(sorted(stop_token_ids), dtype=torch.long)
        # Enough candidates that W of them go on even if every beam's best are stop tokens.
        self.num_candidates = max(2, 1 + len(stop_token_ids)) * self.width
        self.beams = [root]
        self.scores = torch.zeros(1)
        self.finished: list[Hypothesis] = []
        self.done = False

    @property
    def num_generated(self) -> int:
        return len(self.beams[0].output_token_ids)

    def select(self, logits: torch.Tensor) -> list[tuple[int, int]]:
        """One step from the running beams' logits ``[len(beams), vocab]``, row i beam i.

        Records the hypotheses that finish; returns the next running beams as
        (index of the parent in ``beams``, token), best first, or [] once the search
        is ``done``. Raises BeamSearchError (nothing changed) on non-finite logits.
        """
        if logits.dim() != 2 or logits.shape[0] != len(self.beams):
            raise ValueError(f"{len(self.beams)} beams but logits of shape {tuple(logits.shape)}")
        if not bool(torch.isfinite(logits).all()):
            raise BeamSearchError("the logits hold NaN or infinity")
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if self.num_generated < self.min_tokens and len(self._stop_index):
            logprobs[:, self._stop_index.to(logprobs.device)] = float("-inf")
        totals = (logprobs + self.scores.to(logprobs.device)[:, None]).view(-1)
        top, index = torch.topk(totals, min(self.num_candidates, totals.numel()))
        top, index = top.cpu(), index.cpu()
        vocab = logits.shape[1]
        parents = (index // vocab).tolist()
        tokens = (index % vocab).tolist()
        length = self.num_generated + 1  # each continuation's generated tokens
        at_limit = length >= self.max_new_tokens
        ended = [at_limit or token in self.stop_token_ids for token in tokens]
        # fp32, as transformers divides: its ranking, ties and all.
        normalized = (top / (length**self.length_penalty)).tolist()
        new = [
            Hypothesis(
                (*self.beams[parents[rank]].output_token_ids, tokens[rank]),
                normalized[rank],
                "stop" if tokens[rank] in self.stop_token_ids else "length",
            )
            for rank in range(min(self.width, len(tokens)))
            if ended[rank]
        ]
        if new:
            # Stable: on a tie the hypothesis found earlier stays ahead.
            merged = sorted(self.finished + new, key=lambda h: h.score, reverse=True)
            self.finished = merged[: self.width]
        running = [rank for rank in range(len(tokens)) if not ended[rank]][: self.width]
        self.scores = top[running]
        self.done = not running or self._cannot_improve(length)
        if self.done:
            return []
        return [(parents[rank], tokens[rank]) for rank in running]

    def _cannot_improve(self, length: int) -> bool:
        """Whether the search ends now that every running beam holds ``length`` tokens."""
        if len(self.finished) < self.width:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_new_tokens
        best = float(self.scores[:1] / (length**self.length_penalty))
        return not best > self.finished[-1].score

    def advance(
        self,
        picks: list[tuple[int, int]],
        fork: Callable[[Sequence], Sequence],
        drop: Callable[[Sequence], None],
        now: float,
    ) -> None:
        """Make the running beams the ``picks`` of the last ``select``.

        A parent's first pick takes its sequence over, each further pick is
        ``fork(parent)`` (made before any token is appended, so it copies the
        parent's tokens as they were), and a parent with no pick is ``drop``\\ ped.
        Then every beam takes its token.
        """
        parents = self.beams
        taken: set[int] = set()
        beams = []
        for parent_index, _ in picks:
            parent = parents[parent_index]
            beams.append(fork(parent) if parent_index in taken else parent)
            taken.add(parent_index)
        for index, parent in enumerate(parents):
            if index not in taken:
                drop(parent)
        for beam, (_, token) in zip(beams, picks, strict=True):
            beam.append_token(token, now)
        self.beams = beams

    def results(self) -> list[Hypothesis]:
        """The ``n`` best hypotheses, best first (once ``done``)."""
        return self.finished[: self.num_results]

    def restart(self) -> Sequence:
        """Start over from the prompt: the scheduler preempted every beam (their blocks
        are freed). Returns the one sequence to queue, holding the prompt alone.

        The search runs again from its first step. Nothing of it was streamed and it
        picks deterministically from logits that do not depend on the batch or the
        cache (``kernels/invariance.py``), so the answer is the one it would have
        given; the prompt's blocks come back from the prefix index.
        """
        root = self.beams[0]
        for beam in self.beams[1:]:
            beam.status = SequenceStatus.FINISHED
        root.output_token_ids.clear()
        root.block_chain = None
        self.beams = [root]
        self.scores = torch.zeros(1)
        self.finished = []
        self.done = False
        return root
