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
