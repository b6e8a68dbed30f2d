"""Pick the next token of every sequence in a batch from its logits.

Greedy rows are one vectorised argmax. Sampled rows go one by one, each drawing
from its own ``torch.Generator``: a row's draw then depends only on its own
logits and seed, never on which other sequences share the batch, which is
what makes "same seed -> same output" hold under continuous batching.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from chatsvc.engine.request import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one sample; an unseeded one still gets a fresh random seed."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else random.SystemRandom().getrandbits(63))
    return generator


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities ``[V]`` (fp32) after temperature, top-k, top-p; zero outside the kept set."""
    if params.temperature <= 0.0:
        raise ValueError("filtered_probs needs temperature > 0; greedy rows use argmax")
    scaled = logits.float() / params.temperature
    vocab_size = scaled.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
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


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Next token per row of ``logits [B, V]``; ``params[i]`` and ``generators[i]`` belong to row i.

    Greedy rows (temperature 0) may pass ``None`` as generator; sampled rows must not.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    num_rows = logits.shape[0]
    if len(params) != num_rows or len(generators) != num_rows:
        raise ValueError(
            f"{num_rows} logit rows but {len(params)} params and {len(generators)} generators"
        )
    tokens = [0] * num_rows
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    if greedy_rows:
        index = torch.tensor(greedy_rows, dtype=torch.long, device=logits.device)
        picked = torch.argmax(logits.index_select(0, index), dim=-1).tolist()
        for row, token in zip(greedy_rows, picked, strict=True):
            tokens[row] = token
    for row, p in enumerate(params):
        if p.is_greedy:
            continue
        generator = generators[row]
        if generator is None:
            raise ValueError(
                f"row {row} samples with temperature {p.temperature} but has no generator"
            )
        probs = filtered_probs(logits[row].cpu(), p)
        tokens[row] = int(torch.multinomial(probs, 1, generator=generator).item())
    return tokens
