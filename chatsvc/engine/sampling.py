"""Pick the next token of every sequence in a batch from its logits.

Greedy rows are one vectorised argmax. Sampled rows go one by one, each drawing
from its own ``torch.Generator``: a row's draw then depends only on its own
logits and seed, never on which other sequences share the batch, which is
what makes "same seed -> same output" hold under continuous batching.

Rows fail alone: ``sample_rows`` hands back an error for a row whose logits are
not finite or whose draw fails, and every other row's token is the one it would
have drawn without that row.

A row whose request asks for logit processing (penalties, ``logit_bias``,
``min_tokens``: ``logits_processing``) is processed on a copy of the batch's
logits before the argmax or the draw; the model's own logits stay as they were
(log-probabilities are taken from them).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from chatsvc.engine.logits_processing import LogitsState
from chatsvc.protocol import SamplingParams


class SamplingError(RuntimeError):
    """One row could not be sampled (its logits hold NaN or infinity, or the draw failed)."""


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one sample; an unseeded one still gets a fresh random seed."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else random.SystemRandom().getrandbits(63))
    return generator


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[V]`` (fp32) after temperature, top-k, min-p, top-p; zero outside
    the kept set.

    ``logits`` must be finite but for ``-inf`` entries (tokens masked out by logit
    processing). The row's maximum is subtracted before dividing by the temperature,
    so every scaled value is <= 0 and nothing overflows for any temperature the
    greedy line lets through.
    """
    if params.is_greedy:
        raise ValueError(
            f"filtered_probs needs a sampling temperature; {params.temperature} is greedy (argmax)"
        )
    logits = logits.float()
    scaled = (logits - logits.max()) / params.temperature
    vocab_size = scaled.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.min_p > 0.0:
        # The top token's probability is at least 1/V, so the threshold is never 0 and
        # the top token always stays.
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest head of the sorted list whose mass reaches top_p: a
        # token is dropped when the mass strictly before it already reaches it.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[0] = False
        drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    states: Sequence[LogitsState | None] | None = None,
) -> list[int | SamplingError]:
    """Next token per row of ``logits [B, V]``, or the SamplingError that row ended with.

    ``params[i]``, ``generators[i]`` and ``states[i]`` belong to row i. Greedy rows may
    pass ``None`` as generator; sampled rows must not. ``states[i]`` (None: no
    processing) processes row i before its pick; ``logits`` itself is not changed.
    A bad row never changes another row's token or advances another row's generator.
    Raises ValueError when the arguments do not line up (a caller's bug, not a row's).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0]
    if len(params) != num_rows or len(generators) != num_rows:
        raise ValueError(
            f"{num_rows} logit rows but {len(params)} params and {len(generators)} generators"
        )
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if generator is None and not p.is_greedy:
            raise ValueError(
                f"row {row} samples with temperature {p.temperature} but has no generator"
            )
    if states is not None and len(states) != num_rows:
        raise ValueError(f"{num_rows} logit rows but {len(states)} logit states")
    results: list[int | SamplingError] = [0] * num_rows
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    for row, ok in enumerate(finite):
        if not ok:
            results[row] = SamplingError(f"row {row}: the logits hold NaN or infinity")
    logits = _processed(logits, states, finite, results)
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy and finite[i]]
    if greedy_rows:
        index = torch.tensor(greedy_rows, dtype=torch.long, device=logits.device)
        picked = torch.argmax(logits.index_select(0, index), dim=-1).tolist()
        for row, token in zip(greedy_rows, picked, strict=True):
            results[row] = token
    for row, p in enumerate(params):
        if p.is_greedy or not finite[row]:
            continue
        results[row] = _draw(row, logits[row], p, generators[row])
    return results


def _processed(
    logits: torch.Tensor,
    states: Sequence[LogitsState | None] | None,
    finite: list[bool],
    results: list[int | SamplingError],
) -> torch.Tensor:
    """A copy of ``logits`` with each row's own processing applied (``logits`` when none).

    A row whose processing fails gets its SamplingError in ``results`` and is marked
    not ``finite`` so nothing is drawn for it.
    """
    rows = [i for i, s in enumerate(states or ()) if s is not None and finite[i]]
    if not rows:
        return logits
    processed = logits.to(torch.float32, copy=True)
    for row in rows:
        try:
            states[row].apply_(processed[row])
        except (RuntimeError, IndexError) as error:  # torch's refusal, this row's alone
            failure = SamplingError(f"row {row}: logit processing failed: {error}")
            failure.__cause__ = error
            results[row] = failure
            finite[row] = False
    return processed


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Next token per row of ``logits [B, V]``; raises the first row's SamplingError.

    For callers that fail as a whole; the engine uses ``sample_rows``.
    """
    results = sample_rows(logits, params, generators)
    for result in results:
        if isinstance(result, SamplingError):
            raise result
    return results


def _draw(
    row: int, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> int | SamplingError:
    try:
        probs = filtered_probs(logits.cpu(), params)
        return int(torch.multinomial(probs, 1, generator=generator).item())
    except RuntimeError as error:  # torch's refusal of a distribution it cannot draw from
        failure = SamplingError(f"row {row}: {error}")
        failure.__cause__ = error
        return failure
