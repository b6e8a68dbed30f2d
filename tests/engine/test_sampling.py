import pytest
import torch

from chatsvc.engine.sampling import filtered_probs, make_generator, sample
from chatsvc.protocol import SamplingParams


def _logits(batch: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = _logits(4)
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy] * 4, [None] * 4) == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7)
    row = _logits(1, seed=3)[0]
    alone = [sample(row[None], [params], [make_generator(7)])[0] for _ in range(1)]
    # The same row inside a bigger batch, with other seeded and greedy rows around it.
    others = _logits(3, seed=11)
    batch = torch.stack([others[0], row, others[1], others[2]])
    mixed = [
        SamplingParams(temperature=1.0, seed=1),
        params,
        SamplingParams(temperature=0.0),
        params,
    ]
    gens = [make_generator(1), make_generator(7), None, make_generator(99)]
    assert sample(batch, mixed, gens)[1] == alone[0]


def test_seeded_stream_repeats_and_different_seeds_differ():
    params = SamplingParams(temperature=1.0)
    logits = torch.zeros(1, 1000)  # uniform: draws are all generator

    def run(seed):
        gen = make_generator(seed)
        return [sample(logits, [params], [gen])[0] for _ in range(20)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_top_k_keeps_only_k_largest():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0, 3.0])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [False, True, False, True, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_smallest_head_reaching_p():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs_in.log()
    kept = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.8)) > 0
    assert kept.tolist() == [True, True, False, False]
    kept = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.81)) > 0
    assert kept.tolist() == [True, True, True, False]
    # The top token always survives, however small p is.
    kept = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.01)) > 0
    assert kept.tolist() == [True, False, False, False]


def test_sampled_tokens_stay_inside_filtered_set():
    logits = _logits(1, vocab=100, seed=4)
    params = SamplingParams(temperature=1.5, top_k=5)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    gen = make_generator(0)
    assert {sample(logits, [params], [gen])[0] for _ in range(200)} <= allowed


def test_low_temperature_approaches_greedy():
    logits = _logits(1, seed=9)
    gen = make_generator(0)
    picks = {sample(logits, [SamplingParams(temperature=1e-4)], [gen])[0] for _ in range(50)}
    assert picks == {int(logits.argmax())}


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(3), [SamplingParams()], [make_generator(0)])
    with pytest.raises(ValueError, match="generators"):
        sample(torch.zeros(2, 5), [SamplingParams()], [make_generator(0)])
    with pytest.raises(ValueError, match="no generator"):
        sample(torch.zeros(1, 5), [SamplingParams(temperature=1.0)], [None])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"n": 0}, "n"),
        ({"n": 10_000}, "n"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop": tuple(str(i) for i in range(100))}, "stop"),
        ({"stop_token_ids": (-3,)}, "stop token"),
    ],
)
def test_sampling_params_validate(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate()


def test_sample_seeds_are_derived_per_index():
    params = SamplingParams(seed=40, n=3).validate()
    assert [params.sample_seed(i) for i in range(3)] == [40, 41, 42]
    assert SamplingParams().sample_seed(2) is None


def _full_sort_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filters by their definition: softmax over the vocabulary, a sort of all of it."""
    scaled = (logits.double() - logits.max()) / params.temperature
    if 0 < params.top_k < len(scaled):
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        drop_sorted[0] = False
        probs = probs.masked_fill(torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted), 0)
        probs = probs / probs.sum()
    return probs


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat to peaked rows
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.2, top_p=0.9),
        SamplingParams(temperature=2.5, top_p=0.99),
        SamplingParams(temperature=1.0, top_p=0.5, min_p=0.01),
        SamplingParams(temperature=0.7, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.8),
        SamplingParams(temperature=1.0),
    ],
    ids=["top_p", "cold_top_p", "hot_top_p", "min_p_top_p", "min_p", "top_k_top_p", "none"],
)
def test_the_filters_keep_what_a_full_sort_of_the_vocabulary_keeps(scale, params):
    # Only the head top-p may keep is sorted; the kept set and its probabilities must
    # be the ones of the definition, also on flat rows where the head is large.
    for seed in range(4):
        logits = _logits(1, vocab=8192, seed=seed)[0] * scale
        expected = _full_sort_reference(logits, params)
        got = filtered_probs(logits, params)
        assert torch.equal(got > 0, expected > 0), (
            seed,
            int((got > 0).sum()),
            int((expected > 0).sum()),
        )
        assert torch.allclose(got.double(), expected, atol=1e-6)


def test_draws_follow_the_kept_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -3.0, -8.0])
    params = SamplingParams(temperature=0.8, top_p=0.97)
    probs = filtered_probs(logits, params).double()
    draws = 40_000
    gen = make_generator(123)
    counts = torch.zeros(len(logits), dtype=torch.float64)
    for token in sample(logits.expand(draws, -1), [params] * draws, [gen] * draws):
        counts[token] += 1
    kept = probs > 0
    assert counts[~kept].sum() == 0  # nothing outside the kept set, ever
    expected = probs[kept] * draws
    chi2 = float((((counts[kept] - expected) ** 2) / expected).sum())
    assert chi2 < 35.0, (chi2, counts.tolist(), expected.tolist())  # df <= 7: p < 1e-5


def test_a_token_masked_by_logit_processing_is_never_kept():
    logits = _logits(1, vocab=2048, seed=8)[0]
    masked = torch.zeros(2048, dtype=torch.bool)
    masked[:300] = True  # the first tokens, where a draw of 0 would land
    logits = logits.masked_fill(masked, float("-inf"))
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1e-3, top_p=0.9)):
        probs = filtered_probs(logits, params)
        assert float(probs[masked].sum()) == 0.0 and probs.sum().item() == pytest.approx(1.0)
