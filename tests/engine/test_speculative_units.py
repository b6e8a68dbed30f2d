"""Speculative decoding's parts without the model: the proposers, adaptive k, and the
verification's distribution (issue 30)."""

from __future__ import annotations

import pytest
import torch

from chatsvc.engine.sampling import filtered_probs, make_generator, sample_rows
from chatsvc.engine.speculative import AdaptiveK
from chatsvc.engine.speculative.ngram import NgramIndex
from chatsvc.engine.speculative.proposer import MAX_COOLDOWN, worth
from chatsvc.engine.speculative.suffix import TenantOutputs
from chatsvc.engine.speculative.verify import verify_draft
from chatsvc.protocol import SamplingParams


def test_ngram_proposes_what_followed_the_longest_suffix_last_time():
    index = NgramIndex(2, 4)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # "1 2 3" (3 tokens) occurred at the start, followed by 4 5 9; "2 3" alone later (7 8).
    assert index.propose(tokens, 3) == [4, 5, 9]
    tokens += [4, 5]
    assert index.propose(tokens, 2) == [9, 2]  # "3 4 5", grown incrementally
    assert index.propose([5, 6, 7], 4) == []  # no earlier occurrence: nothing
    assert NgramIndex(2, 4).propose([6, 6, 6], 3) == [6]  # never the suffix itself


def test_tenant_outputs_stay_with_their_tenant_and_are_bounded():
    store = TenantOutputs(max_tokens=12, min_n=2, max_n=3)
    store.add(b"a", [1, 2, 3, 4, 5, 6])
    assert store.propose(b"a", [9, 1, 2], 3) == [3, 4, 5]
    assert store.propose(b"b", [9, 1, 2], 3) == []  # another tenant's text is not proposed
    store.add(b"b", [1, 2, 7, 7, 7, 7, 7])  # 13 tokens: the oldest document goes
    assert len(store) == 1 and store.num_tokens == 7
    assert store.propose(b"a", [9, 1, 2], 3) == []
    assert store.propose(b"b", [1, 2], 2) == [7, 7]


def test_adaptive_k_follows_acceptance_and_backs_off_when_proposals_fail():
    k = AdaptiveK(max_k=4)
    assert k.wanted() == 4
    k.record(4, 2)
    assert k.wanted() == 3  # accepted + 1
    k.record(3, 0)
    k.record(1, 0)  # two misses in a row: one step without proposals
    assert [k.wanted() for _ in range(2)] == [0, 1]
    for _ in range(40):  # misses keep doubling the pause, up to MAX_COOLDOWN steps
        k.record(1, 0)
        k.record(1, 0)
    pause = 0
    while k.wanted() == 0:
        pause += 1
    assert pause == MAX_COOLDOWN
    k.record(1, 1)
    assert k.backoff == 1 and k.wanted() == 2


DRAWS = 2500


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing drawn that has no probability
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_verification_keeps_the_target_distribution(temperature, top_p):
    """Draws of (first token, second token) through verification of the proposal x
    match p: the first token ~ p (x accepted with probability p(x)), and after an
    accepted x the bonus token ~ the second row's p. Chi-square at p = 0.001."""
    params = SamplingParams(max_tokens=4, temperature=temperature, top_p=top_p)
    first = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0])
    second = torch.tensor([-1.0, 0.0, 2.5, 0.3, 1.0, -0.5, 0.2, 0.0])
    rows = torch.stack([first, second])
    draft = [1]  # probability about 0.26 under the first row
    p1, p2 = filtered_probs(first, params), filtered_probs(second, params)
    generator = make_generator(1234)
    firsts, seconds = torch.zeros(8), torch.zeros(8)

    def pick(row):
        (token,) = sample_rows(row[None], [params], [generator])
        return token

    for _ in range(DRAWS):
        emitted: list[int] = []
        accepted = verify_draft(rows, draft, pick, emitted.append)
        assert accepted == (emitted[0] == draft[0]) and len(emitted) == 1 + accepted
        firsts[emitted[0]] += 1
        if accepted:
            seconds[emitted[1]] += 1
    # 7 degrees of freedom at most: chi-square's 0.999 quantile is 24.3.
    assert chi_square(firsts, p1) < 24.3
    assert chi_square(seconds, p2) < 24.3
    assert abs(firsts[1] / DRAWS - p1[1]) < 0.03


def test_verification_stops_at_the_first_mismatch_and_at_the_end_of_the_request():
    rows = torch.full((4, 6), -5.0)
    for i, token in enumerate([3, 4, 1, 2]):
        rows[i, token] = 5.0  # greedy picks 3, 4, 1, then 2
    greedy = SamplingParams(temperature=0.0)

    def pick(row):
        return sample_rows(row[None], [greedy], [None])[0]

    emitted = []
    assert verify_draft(rows, [3, 4, 1], pick, lambda t: emitted.append(t) or False) == 3
    assert emitted == [3, 4, 1, 2]  # every proposal and the bonus token
    emitted = []
    assert verify_draft(rows, [3, 0, 1], pick, lambda t: emitted.append(t) or False) == 1
    assert emitted == [3, 4]  # row 1 picks 4, not the proposal 0: the run ends with it
    emitted = []
    assert verify_draft(rows, [3, 4, 1], pick, lambda t: emitted.append(t) or len(emitted) == 2)
    assert emitted == [3, 4]  # the request ended at its second token


def test_a_crowded_step_asks_more_of_its_proposals():
    assert worth(1) < 0.25 < 0.6 < worth(8) < 1.0
    alone, crowded = AdaptiveK(max_k=4), AdaptiveK(max_k=4)
    for _ in range(2):  # half of the proposals kept, twice
        alone.record(4, 2, worth(1))
        crowded.record(4, 2, worth(8))
    assert alone.wanted() == 3  # pays alone: goes on
    assert crowded.wanted() == 0  # does not among 8 decodes: backs off
