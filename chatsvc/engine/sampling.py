"""Pick the next token of every sequence in a batch from its logits.

Greedy rows are one vectorised argmax. Sampled rows go one by one, each drawing
one uniform number from its own ``torch.Generator``: a row's draw then depends
only on its own logits and seed, never on which other sequences share the batch,
which is what makes "same seed -> same output" hold under continuous batching.

Rows fail alone: ``sample_rows`` hands back an error for a row whose logits are
not finite or whose draw fails, and every other row's token is the one it would
have drawn without that row.

A row whose request asks for logit processing (penalties, ``logit_bias``,
``min_tokens``: ``logits_processing``) is processed on a copy of the batch's
logits before the argmax or the draw; the model's own logits stay as they were
(log-probabilities are taken from them).
"""

from __future__ import annotations

import math
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


# Top-p sorts only the tokens it may keep: they are grouped by how many factors of e
# they are below the top token, and the groups past the first whose cumulative mass
# reaches top_p are never sorted. The last group holds everything below e^-63 of the top.
E_FOLD_GROUPS = 64
# A token more than e^80 less likely than the top one is counted at e^-80: exp() of
# what is below turns subnormal in fp32 and runs several times slower (most of a row
# at low temperature), and a draw from a float64 uniform cannot pick a token of that
# mass anyway.
NEGLIGIBLE_LOGIT = -80.0


def candidates(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens a sampled row may draw and their probabilities, ``(token_ids, probs)``:
    temperature, then top-k, min-p and top-p, each renormalizing what it keeps. The
    order is the likeliest first when top-k or top-p applies, else the vocabulary's.

    A full sort of the vocabulary per row and step was most of a sampled step with
    the default top-p; here top-k sorts its ``k`` tokens and top-p only the groups of
    tokens it may keep (``_likeliest``). ``logits`` must be finite but for ``-inf``
    entries (tokens masked out by logit processing). The row's maximum is subtracted
    before dividing by the temperature, so every scaled value is <= 0 and nothing
    overflows for any temperature the greedy line lets through. Raises RuntimeError
    when no token has a probability.
    """
    if params.is_greedy:
        raise ValueError(
            f"sampling needs a sampling temperature; {params.temperature} is greedy (argmax)"
        )
    logits = logits.float()
    scaled = (logits - logits.max()) / params.temperature
    masked = torch.isneginf(scaled) if float(scaled.min()) == float("-inf") else None
    scaled = scaled.clamp_(min=NEGLIGIBLE_LOGIT)
    if masked is not None:  # logit processing's -inf stays: such a token is never drawn
        scaled = scaled.masked_fill_(masked, float("-inf"))
    vocab_size = scaled.shape[-1]
    likeliest_first = 0 < params.top_k < vocab_size
    if likeliest_first:
        scaled, ids = torch.topk(scaled, params.top_k)
    else:
        ids = torch.arange(vocab_size)
    probs = torch.softmax(scaled, dim=-1)
    if not float(probs.sum()) > 0:  # NaN fails this too
        raise RuntimeError("no token of this row has a probability to draw")
    if params.min_p > 0.0:
        # At least min_p times the top token's probability, whose scaled logit is 0. The
        # top token always stays.
        keep = (scaled >= math.log(params.min_p)).nonzero().squeeze(1)
        ids, scaled, probs = ids[keep], scaled[keep], probs[keep]
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        if not likeliest_first:
            head, probs = _likeliest(scaled, probs, params.top_p)
            ids = ids[head]
        # Keep the smallest head whose mass reaches top_p: a token is dropped when the
        # mass strictly before it already reaches it. The top token always stays.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep = mass_before < params.top_p
        keep[0] = True
        probs, ids = probs[keep], ids[keep]
        probs = probs / probs.sum()
    return ids, probs


def _likeliest(
    scaled: torch.Tensor, probs: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions, probs)`` of the row's likeliest tokens, likeliest first, cut after the
    e-fold group (``E_FOLD_GROUPS``) where the mass reaches ``top_p``: every token cut is
    below every token kept and has at least ``top_p`` before it, so top-p drops it."""
    group = scaled.neg().clamp_(max=E_FOLD_GROUPS - 1).long()
    mass = torch.zeros(E_FOLD_GROUPS).index_add_(0, group, probs)
    reached = torch.cumsum(mass, dim=0) >= top_p
    last = int(reached.int().argmax()) if bool(reached.any()) else E_FOLD_GROUPS - 1
    head = (group <= last).nonzero().squeeze(1)
    probs, order = torch.sort(probs[head], descending=True)
    return head[order], probs


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[V]`` (fp32) after temperature, top-k, min-p, top-p (``candidates``);
    zero outside the kept set."""
    ids, probs = candidates(logits, params)
    return torch.zeros(logits.shape[-1], dtype=torch.float32).index_put_((ids,), probs)


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
    """One token from the row's kept set, by one uniform number from its generator
    (inverse of the kept set's cumulative mass: a token of zero probability is never
    picked)."""
    try:
        ids, probs = candidates(logits.cpu(), params)
        mass = torch.cumsum(probs.double(), dim=-1)
        point = torch.rand(1, generator=generator, dtype=torch.float64) * mass[-1]
        pick = min(int(torch.searchsorted(mass, point, right=True)), len(ids) - 1)
        return int(ids[pick])
    except RuntimeError as error:  # a distribution that cannot be drawn from
        failure = SamplingError(f"row {row}: {error}")
        failure.__cause__ = error
        return failure
