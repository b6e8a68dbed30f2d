"""Beam search without a model: the request's rules, the peak bound, one selection step.

The search's agreement with transformers' ``generate(num_beams=...)`` on the real
model is tests/engine/test_beam_search.py; here each rule is pinned on logits made
by hand, so a failure names the rule.
"""

from __future__ import annotations

import math

import pytest
import torch

from chatsvc.engine.beam_search import BeamSearch, BeamSearchError, peak_blocks
from chatsvc.engine.sequence import Sequence, SequenceStatus
from chatsvc.protocol import RequestValidationError, SamplingParams

STOP = 0
VOCAB = 8


def beam_params(**fields) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, "temperature": 0.0, "beam_width": 2, **fields})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"beam_width": 9}, r"beam_width must be an integer in \[1, 8\]"),
        ({"beam_width": 0}, "beam_width must be"),
        ({"beam_width": True}, "beam_width must be"),
        ({"n": 3}, r"n \(3\) must not exceed beam_width \(2\)"),
        ({"temperature": 0.7}, "does not sample: temperature must be 0"),
        ({"top_p": 0.9}, "top_p must be 1"),
        ({"top_k": 5}, "top_k must be 0"),
        ({"min_p": 0.1}, "min_p must be 0"),
        ({"repetition_penalty": 1.1}, "no repetition, frequency or presence penalty"),
        ({"logit_bias": ((5, 1.0),)}, "no logit_bias"),
        ({"logprobs": 1}, "no logprobs"),
        ({"stop": ("x",)}, r"no stop strings \(stop_token_ids work\)"),
        ({"length_penalty": 4.5}, r"length_penalty must be in \[-4, 4\]"),
        ({"length_penalty": float("nan")}, "length_penalty must be"),
        ({"early_stopping": "always"}, 'early_stopping must be true, false or "never"'),
        ({"early_stopping": 1}, "early_stopping must be"),
        ({"beam_width": 1, "length_penalty": 0.5}, "apply to beam search only"),
        ({"beam_width": 1, "early_stopping": True}, "apply to beam search only"),
    ],
)
def test_a_bad_beam_request_is_refused_naming_its_field(fields, message):
    with pytest.raises(RequestValidationError, match=message):
        beam_params(**fields).validate(VOCAB)


def test_a_good_beam_request_passes():
    params = beam_params(
        beam_width=8, n=8, length_penalty=-1.5, early_stopping="never", min_tokens=2, seed=3
    )
    assert params.validate(VOCAB).is_beam_search
    assert not SamplingParams().validate().is_beam_search


@pytest.mark.parametrize(
    ("num_prompt", "longest", "width"), [(100, 164, 4), (96, 97, 4), (1000, 1128, 8), (5, 6, 2)]
)
def test_peak_blocks_is_within_the_issue_bound(num_prompt, longest, width):
    bs = 16
    peak = peak_blocks(num_prompt, longest, width, bs)
    answer = longest - num_prompt
    assert peak <= math.ceil(num_prompt / bs) + width * math.ceil(answer / bs) + width
    # Every beam at full length holds all its blocks but the prompt's full ones itself.
    shared = num_prompt // bs
    assert peak >= shared + width * (math.ceil(longest / bs) - shared)


def make_search(**fields) -> BeamSearch:
    params = beam_params(**fields)
    root = Sequence(0, None, 0, [5, 6, 7], detokenizer=None, generator=None)
    return BeamSearch(root, params, frozenset({STOP}), params.max_tokens)


def logits_for(*rows: dict[int, float]) -> torch.Tensor:
    """Logits whose softmax gives each row's listed token that probability (the rest
    share what is left)."""
    out = torch.empty(len(rows), VOCAB)
    for i, probs in enumerate(rows):
        rest = (1.0 - sum(probs.values())) / (VOCAB - len(probs))
        out[i] = torch.tensor([math.log(probs.get(t, rest)) for t in range(VOCAB)])
    return out


def advance(search: BeamSearch, picks) -> list[Sequence]:
    forked, dropped = [], []

    def fork(parent: Sequence) -> Sequence:
        child = Sequence(100 + len(forked), None, 0, parent.prompt_token_ids, None, None)
        child.output_token_ids = list(parent.output_token_ids)
        forked.append(child)
        return child

    search.advance(picks, fork, dropped.append, now=0.0)
    return dropped


def test_the_first_step_fans_out_from_the_prompt_and_a_stop_ranked_first_finishes():
    search = make_search(beam_width=2)
    picks = search.select(logits_for({STOP: 0.5, 3: 0.3, 4: 0.15}))
    # The stop token ranked first (within W): a hypothesis of length 1; the beams go
    # on with the best two that do not end.
    assert search.finished[0].token_ids == (STOP,)
    assert search.finished[0].finish_reason == "stop"
    assert search.finished[0].score == pytest.approx(math.log(0.5))
    assert picks == [(0, 3), (0, 4)]
    root = search.beams[0]
    assert advance(search, picks) == []
    assert search.beams[0] is root and root.output_token_ids == [3]
    assert search.beams[1].output_token_ids == [4]
    assert search.scores.tolist() == pytest.approx([math.log(0.3), math.log(0.15)])


def test_a_stop_token_ranked_below_the_width_does_not_finish_and_a_pruned_beam_drops():
    search = make_search(beam_width=2)
    advance(search, search.select(logits_for({3: 0.5, 4: 0.4})))
    # Beam [3] carries on twice; beam [4]'s best is a stop token, ranked third of the
    # candidates (outside the first W): no hypothesis, and beam [4] has no child.
    picks = search.select(logits_for({5: 0.5, 6: 0.45}, {STOP: 0.5}))
    assert search.finished == []
    assert picks == [(0, 5), (0, 6)]
    other = search.beams[1]
    assert advance(search, picks) == [other]
    assert [b.output_token_ids for b in search.beams] == [[3, 5], [3, 6]]


def test_length_penalty_ranks_hypotheses_by_sum_over_length():
    search = make_search(beam_width=2, length_penalty=1.0, max_tokens=3)
    advance(search, search.select(logits_for({3: 0.6, STOP: 0.3})))
    assert search.finished[0].score == pytest.approx(math.log(0.3))
    picks = search.select(logits_for({4: 0.9}, {STOP: 0.9}))
    advance(search, picks)
    # [3, 4] ... and the other beam ended: log(p)/2 beats the length-1 hypothesis.
    scores = [h.score for h in search.finished]
    assert scores == sorted(scores, reverse=True) and len(scores) == 2
    assert search.select(logits_for({5: 0.9}, {5: 0.9})) == []  # max_tokens: all end
    assert search.done
    assert [h.finish_reason for h in search.finished].count("length") >= 1


def test_early_stopping_true_ends_as_soon_as_width_hypotheses_are_finished():
    search = make_search(beam_width=2, early_stopping=True)
    advance(search, search.select(logits_for({STOP: 0.4, 3: 0.35, 4: 0.2})))
    picks = search.select(logits_for({STOP: 0.9}, {5: 0.9}))
    assert picks == [] and search.done and len(search.finished) == 2


def test_early_stopping_false_goes_on_while_a_running_beam_could_still_win():
    search = make_search(beam_width=2, early_stopping=False, length_penalty=2.0)
    advance(search, search.select(logits_for({STOP: 0.4, 3: 0.35, 4: 0.2})))
    # Two hypotheses finished, but the best running beam ([4, 6]) scored at its length
    # (2) with a length penalty of 2 still beats the worst of them: the search goes on.
    picks = search.select(logits_for({STOP: 0.6, 5: 0.35}, {6: 0.9}))
    assert len(search.finished) == 2 and not search.done
    assert picks == [(1, 6), (0, 5)]
    best = float(search.scores[0]) / 2**2
    assert best > search.finished[-1].score


def test_min_tokens_masks_the_stop_tokens_first():
    search = make_search(beam_width=2, min_tokens=1)
    picks = search.select(logits_for({STOP: 0.9, 3: 0.05}))
    assert search.finished == [] and all(token != STOP for _, token in picks)


def test_non_finite_logits_raise_and_change_nothing():
    search = make_search()
    logits = logits_for({3: 0.5})
    logits[0, 2] = float("nan")
    with pytest.raises(BeamSearchError, match="NaN"):
        search.select(logits)
    assert search.finished == [] and search.scores.tolist() == [0.0] and not search.done


def test_restart_goes_back_to_the_prompt():
    search = make_search(beam_width=2)
    advance(search, search.select(logits_for({STOP: 0.5, 3: 0.3, 4: 0.15})))
    beams = list(search.beams)
    root = search.restart()
    assert root is beams[0] and root.output_token_ids == [] and search.beams == [root]
    assert beams[1].status is SequenceStatus.FINISHED
    assert search.finished == [] and search.scores.tolist() == [0.0]
