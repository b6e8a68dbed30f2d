"""The engine's vLLM-style controls on the real SmolLM2 model (fp32).

Logprobs against transformers' own forward; per-request processing inside a
co-batched step compared with solo runs; ignore_eos, min_tokens and prompt
logprobs through chunked prefill and a warm prefix cache.
"""

from __future__ import annotations

import pytest
import torch

from cache import Namespace
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine
from chatsvc.protocol import GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow
NS = Namespace(tenant_salt=b"tenant-o", label="o")
# Same bound as test_model_forward's logits: fp32 on both sides, only summation order
# differs; a wrong position or row would be off by whole units.
ATOL = 2e-3
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


def make_engine(loaded, **overrides) -> LLMEngine:
    config = dict(dtype="fp32", block_size=16, num_gpu_blocks=128, debug_checks=True)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config), loaded=loaded)


def prompt(engine, question: str) -> list[int]:
    return engine.chat_format.render([{"role": "user", "content": question}])


def request(engine, request_id, question, **sampling) -> GenerationRequest:
    params = SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **sampling})
    return GenerationRequest(request_id, prompt(engine, question), params, NS)


def run(engine, requests) -> dict[str, list]:
    """Add every request, step to the end; the deltas of each request id, in order."""
    for r in requests:
        engine.add_request(r)
    deltas: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None, out.error
            deltas[out.request_id].append(out.delta)
    assert engine.cache_stats()["device"]["used"] == 0
    return deltas


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # [S, V]: row p scores token p + 1


@pytest.fixture(scope="module")
def engine(smollm2_fp32) -> LLMEngine:
    return make_engine(smollm2_fp32)


def test_logprobs_match_transformers(engine, smollm2_hf_fp32):
    r = request(engine, "lp", QUESTIONS[0], logprobs=5, prompt_logprobs=3)
    deltas = run(engine, [r])["lp"]
    out = tokens(deltas)
    expected = hf_logprobs(smollm2_hf_fp32, r.prompt_token_ids + out)
    num_prompt = len(r.prompt_token_ids)

    scores = [s for d in deltas for s in d.logprobs]
    assert [s.token_id for s in scores] == out
    for i, score in enumerate(scores):
        row = expected[num_prompt - 1 + i]
        assert score.logprob == pytest.approx(float(row[score.token_id]), abs=ATOL)
        assert score.rank == 1  # greedy
        top_ids, top_values = zip(*score.top, strict=True)
        assert list(top_ids) == torch.topk(row, 5).indices.tolist()
        torch.testing.assert_close(
            torch.tensor(top_values), torch.topk(row, 5).values, atol=ATOL, rtol=0
        )

    prompt_scores = deltas[0].prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert len(prompt_scores) == num_prompt and prompt_scores[0] is None
    for p in range(1, num_prompt):
        score, row = prompt_scores[p], expected[p - 1]
        assert score.token_id == r.prompt_token_ids[p]
        assert score.logprob == pytest.approx(float(row[score.token_id]), abs=ATOL)
        value = row[score.token_id]
        assert int((row > value + ATOL).sum()) < score.rank <= int((row >= value - ATOL).sum())
        assert [t for t, _ in score.top] == torch.topk(row, 3).indices.tolist()


def test_prompt_logprobs_through_chunks_and_a_warm_cache(smollm2_fp32):
    # 16-token steps: the prompt is scored over several chunks. The first request
    # leaves the whole prompt in the prefix cache; the scored one must not use it.
    engine = make_engine(smollm2_fp32, max_num_batched_tokens=16)
    warm = request(engine, "warm", QUESTIONS[1])
    run(engine, [warm])
    cold = make_engine(smollm2_fp32)
    expected = run(cold, [request(cold, "ref", QUESTIONS[1], prompt_logprobs=2)])["ref"]
    got = run(engine, [request(engine, "scored", QUESTIONS[1], prompt_logprobs=2)])["scored"]
    assert got[-1].metrics.cached_prompt_tokens == 0
    ours, ref = got[0].prompt_logprobs, expected[0].prompt_logprobs
    assert [s and s.token_id for s in ours] == [s and s.token_id for s in ref]
    for a, b in zip(ours[1:], ref[1:], strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=ATOL)
    # Its blocks were indexed as usual: the next plain request hits them.
    again = run(engine, [request(engine, "again", QUESTIONS[1])])["again"]
    assert again[-1].metrics.cached_prompt_tokens > 0


def test_processing_stays_in_its_own_row_of_a_mixed_batch(engine, monkeypatch):
    special = dict(
        repetition_penalty=1.8,
        frequency_penalty=1.5,
        presence_penalty=1.0,
        logit_bias=((28, 8.0), (30, -50.0)),
        min_tokens=3,
        max_tokens=10,
    )
    plain = [request(engine, f"p{i}", q, max_tokens=10) for i, q in enumerate(QUESTIONS)]
    odd = request(engine, "odd", QUESTIONS[0], **special)
    solo = {r.request_id: tokens(run(engine, [r])[r.request_id]) for r in [*plain, odd]}
    assert solo["odd"] != solo["p0"]  # the processing changes that request's answer

    batch_sizes = []
    forward = engine.runner.forward

    def counting(items, cache):
        batch_sizes.append(len(items))
        return forward(items, cache)

    monkeypatch.setattr(engine.runner, "forward", counting)
    mixed = run(engine, [odd, *plain])
    assert batch_sizes and all(size == 4 for size in batch_sizes[:8])  # co-batched throughout
    assert {k: tokens(v) for k, v in mixed.items()} == solo


def test_penalty_history_grows_with_each_token(engine):
    r = request(engine, "hist", QUESTIONS[1], frequency_penalty=0.5, repetition_penalty=1.2)
    engine.add_request(r)
    seq = engine._requests["hist"].seqs[0]
    state = seq.logits_state
    while engine.has_unfinished_requests:
        engine.step()
    # The same object all along, updated token by token: it matches the finished output.
    assert seq.logits_state is state
    counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=state.counts.numel())
    assert torch.equal(state.counts.long(), counts)
    assert state.seen[seq.prompt_token_ids + seq.output_token_ids].all()
    assert int(state.seen.sum()) == len(set(seq.prompt_token_ids + seq.output_token_ids))


def test_ignore_eos_and_min_tokens(engine):
    eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    forced = dict(logit_bias=((eos, 100.0),), max_tokens=6)
    stops = run(engine, [request(engine, "s", QUESTIONS[0], **forced)])["s"]
    assert tokens(stops) == [eos] and stops[-1].finish_reason == "stop"

    ignored = run(engine, [request(engine, "i", QUESTIONS[0], ignore_eos=True, **forced)])["i"]
    assert tokens(ignored) == [eos] * 6 and ignored[-1].finish_reason == "length"

    late = run(engine, [request(engine, "m", QUESTIONS[0], min_tokens=4, **forced)])["m"]
    out = tokens(late)
    assert len(out) == 5 and eos not in out[:4] and out[4] == eos
    assert late[-1].finish_reason == "stop"
