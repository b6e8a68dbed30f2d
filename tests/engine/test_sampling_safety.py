"""Sampling is numerically safe for every valid input, and a bad row fails alone."""

from __future__ import annotations

import pytest
import torch

from chatsvc.engine.sampling import SamplingError, filtered_probs, make_generator, sample_rows
from chatsvc.protocol import MIN_SAMPLING_TEMPERATURE, SamplingParams


def _logits(batch: int, vocab: int = 64, seed: int = 0, scale: float = 30.0) -> torch.Tensor:
    # Real models' logits reach a few tens; the scale makes overflow easy to hit.
    return scale * torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("temperature", [1e-40, 1e-46, 1e-300, 5e-324, 9.9e-6])
def test_a_tiny_temperature_is_greedy(temperature):
    params = SamplingParams(temperature=temperature, seed=3).validate()
    assert params.is_greedy
    logits = _logits(3)
    got = sample_rows(logits, [params] * 3, [make_generator(3)] * 3)
    assert got == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [MIN_SAMPLING_TEMPERATURE, 1e-3, 1.0, 1e30, 1e300])
def test_every_sampling_temperature_gives_a_distribution(temperature):
    params = SamplingParams(temperature=temperature, top_k=10, top_p=0.9)
    logits = _logits(1, scale=1e4)[0]  # values far past what exp() survives unshifted
    probs = filtered_probs(logits, params)
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)
    token = sample_rows(logits[None], [params], [make_generator(0)])[0]
    assert isinstance(token, int) and probs[token] > 0
    if temperature <= 1e-3:  # gaps of 1e4 at this temperature: the top token only
        assert token == int(logits.argmax())


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("greedy", [True, False])
def test_a_row_with_non_finite_logits_fails_alone(poison, greedy):
    logits = _logits(4, seed=5)
    bad = logits.clone()
    bad[1, 7] = poison
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0 if greedy else 0.8, seed=1),
        SamplingParams(temperature=0.9, seed=11),
        SamplingParams(temperature=1.3, top_k=5, seed=12),
    ]

    def generators():
        return [None, make_generator(1), make_generator(11), make_generator(12)]

    clean = sample_rows(logits, params, generators())
    got = sample_rows(bad, params, generators())
    assert isinstance(got[1], SamplingError) and "NaN or infinity" in str(got[1])
    # Every other row drew exactly what it draws when row 1 is healthy.
    assert [got[i] for i in (0, 2, 3)] == [clean[i] for i in (0, 2, 3)]
