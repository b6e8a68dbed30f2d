"""Prompt logprobs recorded chunk by chunk (chatsvc/engine/prompt_logprobs.py), without a
model: the rows a step asks for and what it records from them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from chatsvc.engine.prompt_logprobs import num_logit_rows, take_prompt_logprobs

VOCAB = 11


def scored_sequence(prompt: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        seq_id=7,
        prompt_token_ids=prompt,
        num_prompt_tokens=len(prompt),
        prompt_logprobs=[None],
        sampling=SimpleNamespace(prompt_logprobs=1),
    )


def chunk(seq, start: int, num_new_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(seq=seq, start=start, num_new_tokens=num_new_tokens, num_rows=1)


def test_a_chunk_of_one_prompt_token_is_scored_and_the_next_chunk_follows_it():
    """Regression (found by bench.reliability.bounded_cost at 128-token steps): a chunk
    holding one prompt token asked for one row, which was taken for the last-token row
    alone; its score was never recorded and the next chunk failed ("rows from position
    1, but 1 tokens are scored"), a 500 for the request."""
    prompt = [5, 6, 7, 8, 9]
    seq = scored_sequence(prompt)
    logits = torch.randn(len(prompt), VOCAB, generator=torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits, dim=-1)

    first = chunk(seq, 0, 1)
    assert num_logit_rows(first) == 1
    last, failures = take_prompt_logprobs([first], logits[0:1])
    assert failures == {} and torch.equal(last, logits[0:1])
    assert len(seq.prompt_logprobs) == 2

    rest = chunk(seq, 1, 4)
    assert num_logit_rows(rest) == 4
    last, failures = take_prompt_logprobs([rest], logits[1:5])
    assert failures == {} and torch.equal(last, logits[4:5])
    scores = seq.prompt_logprobs
    assert [s.token_id for s in scores[1:]] == prompt[1:]
    for p, score in enumerate(scores[1:]):
        assert score.logprob == float(expected[p, prompt[p + 1]])


def test_a_batch_mixing_a_one_row_scored_chunk_and_plain_items_keeps_each_last_row():
    prompt = [1, 2, 3]
    seq = scored_sequence(prompt)
    plain = SimpleNamespace(
        seq=SimpleNamespace(prompt_logprobs=None), start=4, num_new_tokens=1, num_rows=1
    )
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    last, failures = take_prompt_logprobs([plain, chunk(seq, 0, 1)], logits)
    assert failures == {} and torch.equal(last, logits)
    assert seq.prompt_logprobs[1].token_id == 2
