"""Per-request logit processing and the new sampling fields, without a model."""

from __future__ import annotations

import pytest
import torch

from chatsvc.engine.detokenizer import IncrementalDetokenizer
from chatsvc.engine.logits_processing import LogitsState
from chatsvc.engine.logprobs import token_logprobs
from chatsvc.engine.sampling import filtered_probs, make_generator, sample_rows
from chatsvc.protocol import RequestValidationError, SamplingParams

VOCAB = 32


def _row(seed: int = 0) -> torch.Tensor:
    return 4 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))


def _state(params: SamplingParams, prompt=(), stops=()) -> LogitsState:
    return LogitsState(params, list(prompt), VOCAB, stops)


def test_logit_bias_adds_to_named_tokens_only():
    row = _row()
    state = _state(SamplingParams(logit_bias=((3, 5.0), (7, -100.0))))
    got = row.clone()
    state.apply_(got)
    expected = row.clone()
    expected[3] += 5.0
    expected[7] -= 100.0
    assert torch.equal(got, expected)


def test_min_tokens_masks_stop_tokens_until_enough_are_out():
    state = _state(SamplingParams(min_tokens=2, max_tokens=8), stops=(5, 9))
    for step in range(3):
        got = _row(step)
        state.apply_(got)
        masked = bool(torch.isneginf(got[[5, 9]]).all())
        assert masked == (step < 2)
        assert torch.isfinite(got[[0, 1, 2, 3]]).all()
        state.add_token(1)


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    prompt, outputs = [1, 4, 4, 9], [12, 1, 30]
    params = SamplingParams(repetition_penalty=1.3)
    state = _state(params, prompt)
    for token in outputs:
        state.add_token(token)
    row = _row(3)
    got = row.clone()
    state.apply_(got)
    hf = RepetitionPenaltyLogitsProcessor(1.3)
    expected = hf(torch.tensor([prompt + outputs]), row.clone()[None])[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_frequency_and_presence_count_output_tokens_only():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.5)
    state = _state(params, prompt=[2, 2, 2])
    for token in [6, 6, 6, 8]:
        state.add_token(token)
    row = _row(4)
    got = row.clone()
    state.apply_(got)
    expected = row.clone()
    expected[6] -= 3 * 0.5 + 1.5
    expected[8] -= 1 * 0.5 + 1.5
    torch.testing.assert_close(got, expected)  # token 2 (prompt only) untouched
    assert state.counts.tolist()[6] == 3 and state.num_output_tokens == 4


def test_a_processed_row_never_touches_its_neighbours_or_the_input():
    logits = torch.stack([_row(i) for i in range(4)])
    before = logits.clone()
    greedy = SamplingParams(temperature=0.0)
    biased = SamplingParams(temperature=0.0, logit_bias=((0, 100.0),), presence_penalty=2.0)
    states = [None, _state(biased), None, _state(biased)]
    got = sample_rows(logits, [greedy, biased, greedy, biased], [None] * 4, states)
    assert torch.equal(logits, before)
    alone = sample_rows(logits, [greedy] * 4, [None] * 4)
    assert got[0] == alone[0] and got[2] == alone[2]
    assert got[1] == 0 and got[3] == 0


def test_a_sampled_row_with_processing_keeps_other_rows_draws():
    logits = torch.stack([_row(i) for i in range(3)])
    sampled = SamplingParams(temperature=0.8, seed=3)
    penalised = SamplingParams(temperature=0.8, seed=3, frequency_penalty=2.0)
    state = _state(penalised)
    state.add_token(int(logits[1].argmax()))

    def draw(params, states):
        gens = [make_generator(3) for _ in range(3)]
        return sample_rows(logits, params, gens, states)

    plain = draw([sampled] * 3, None)
    mixed = draw([sampled, penalised, sampled], [None, state, None])
    assert mixed[0] == plain[0] and mixed[2] == plain[2]


def test_min_p_drops_tokens_below_a_share_of_the_top():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filtered_probs(probs_in.log(), SamplingParams(temperature=1.0, min_p=0.2)) > 0
    assert kept.tolist() == [True, True, True, False]
    kept = filtered_probs(probs_in.log(), SamplingParams(temperature=1.0, min_p=1.0)) > 0
    assert kept.tolist() == [True, False, False, False]


def test_token_logprobs_are_log_softmax_with_rank_and_top():
    logits = torch.stack([_row(5), _row(6)])
    scored = token_logprobs(logits, [3, int(logits[1].argmax())], 4)
    logp = torch.log_softmax(logits, dim=-1)
    assert scored[0].logprob == pytest.approx(float(logp[0, 3]))
    assert scored[0].rank == int((logp[0] > logp[0, 3]).sum()) + 1
    assert scored[1].rank == 1
    top_ids = [t for t, _ in scored[0].top]
    assert top_ids == torch.topk(logp[0], 4).indices.tolist()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((VOCAB, 1.0),)}, "logit_bias"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"stop_token_ids": (VOCAB,)}, "stop_token_ids"),
    ],
)
def test_bad_values_name_their_field(fields, named):
    with pytest.raises(RequestValidationError, match=named):
        SamplingParams(**fields).validate(VOCAB)


def test_stop_strings_wait_for_min_tokens():
    class Chars:
        """One character per token id: id i decodes to chr(ord('a') + i)."""

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i) for i in ids)

    tokens = [1, 2, 1, 2, 1]  # "b c b c b"
    early = IncrementalDetokenizer(Chars(), [], stop=("bc",), min_tokens=3)
    text = "".join(early.add_token(t) for t in tokens)
    # "bc" ends at tokens 2 and 4; only the second ends once three tokens are out.
    assert early.stopped_by == "bc" and text + early.flush() == "bc"
    plain = IncrementalDetokenizer(Chars(), [], stop=("bc",))
    assert "".join(plain.add_token(t) for t in tokens) == "" and plain.stopped_by == "bc"


def test_forward_batch_lists_the_logits_rows_asked_for():
    from chatsvc.engine.forward_batch import ForwardBatch

    batch = ForwardBatch.from_lists(
        [[1, 2, 3], [4], [5, 6]], [0, 7, 2], [[0, 1, 2], [7], [10, 11]], [[0], [1, 2], [3]], 8,
        num_logits=[3, 1, 1],
    )  # fmt: skip
    assert batch.logits_indices.tolist() == [0, 1, 2, 3, 5]
    default = ForwardBatch.from_lists([[1, 2, 3], [4]], [0, 7], [[0, 1, 2], [7]], [[0], [1, 2]], 8)
    assert default.logits_indices.tolist() == [2, 3]
    with pytest.raises(ValueError, match="num_logits"):
        ForwardBatch.from_lists([[1]], [0], [[0]], [[0]], 8, num_logits=[2])
