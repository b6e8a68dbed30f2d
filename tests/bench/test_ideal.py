"""Ideal hit rate on a hand-made trace (block size 4), numbers derived by hand."""

from __future__ import annotations

import pytest

from bench.multiturn.ideal import TraceRequest, ideal_hits


def test_hand_made_trace():
    trace = [
        # r0: nothing cached yet. Computes 1..10 and its answer 11, 12, 13.
        TraceRequest(list(range(1, 11)), [11, 12, 13]),
        # r1: next turn; prompt[:-1] = 1..16 -> blocks 1-4, 5-8, 9-12 hit, 13-16 miss.
        TraceRequest(list(range(1, 18))),
        # r2: first block shared, second new -> 4.
        TraceRequest([1, 2, 3, 4, 99, 98, 97, 96, 5]),
        # r3: 5-8 is cached but holds the last prompt token -> only 1-4 counts.
        TraceRequest([1, 2, 3, 4, 5, 6, 7, 8]),
        # r4: same tokens shifted by one: no block matches.
        TraceRequest([50, 1, 2, 3, 4]),
        # r5: same as r2, after r2 computed it -> both blocks.
        TraceRequest([1, 2, 3, 4, 99, 98, 97, 96, 5]),
        # r6: block 5-8 is cached, but under another parent -> 0.
        TraceRequest([9, 9, 9, 9, 5, 6, 7, 8, 1]),
    ]
    hits = ideal_hits(trace, block_size=4)
    assert hits.per_request == (0, 12, 4, 4, 0, 8, 0)
    assert hits.prompt_tokens == 10 + 17 + 9 + 8 + 5 + 9 + 9
    assert hits.cached_tokens == 28
    assert hits.hit_rate == pytest.approx(28 / 67)


def test_answer_tokens_count_only_for_later_requests():
    # The generated tokens become reusable, but not for the request that produced them.
    trace = [TraceRequest([1, 2, 3], [4, 5, 6, 7, 8]), TraceRequest([1, 2, 3, 4, 5, 6, 7, 8, 9])]
    assert ideal_hits(trace, block_size=4).per_request == (0, 8)


def test_identical_concurrent_prompt_counts_once_computed():
    trace = [TraceRequest([7] * 20), TraceRequest([7] * 20)]
    # prompt[:-1] = 19 tokens -> 4 full blocks of 4 for the second.
    assert ideal_hits(trace, block_size=4).per_request == (0, 16)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="empty prompt"):
        ideal_hits([TraceRequest([1]), TraceRequest([])])
    with pytest.raises(ValueError, match="block_size"):
        ideal_hits([TraceRequest([1])], block_size=0)


def test_causal_ideal_counts_only_what_existed_on_arrival():
    shared = list(range(1, 9))  # two full blocks of 4
    trace = [
        # r0: sent at 0, prompt computed at 1.0, answer done at 2.0
        TraceRequest(shared + [20], [21, 22, 23, 24], sent_at=0.0, prompt_done_at=1.0, done_at=2.0),
        # r1: arrives at 0.5, before r0's prompt exists -> 0 (non-causal: 8)
        TraceRequest(shared + [30], sent_at=0.5, prompt_done_at=1.5, done_at=1.6),
        # r2: r0's next turn at 2.5: r0's prompt and answer exist -> blocks 1-4, 5-8, 20-23
        TraceRequest(shared + [20, 21, 22, 23, 24, 40], sent_at=2.5, prompt_done_at=3, done_at=4),
        # r3: at 1.2 only r0's prompt exists (its answer is still being generated) -> 8
        TraceRequest(shared + [20, 21, 22, 23, 24, 50], sent_at=1.2, prompt_done_at=3, done_at=4),
    ]
    ordered = sorted(trace, key=lambda r: r.sent_at)
    assert ideal_hits(ordered, block_size=4, causal=True).per_request == (0, 0, 8, 12)
    assert ideal_hits(ordered, block_size=4).per_request == (0, 8, 12, 12)
