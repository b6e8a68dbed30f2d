"""LLMEngine on the real SmolLM2 model (fp32): exactness, prefix reuse, n > 1, small pools."""

from __future__ import annotations

import pytest
import torch

from cache import Namespace
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine
from chatsvc.protocol import GenerationRequest, RequestTooLargeError, SamplingParams

pytestmark = pytest.mark.slow
NS = Namespace(tenant_salt=b"tenant-a", label="a")
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Why is the sky blue? Answer briefly.",
]


def make_engine(loaded, **overrides) -> LLMEngine:
    config = dict(dtype="fp32", block_size=16, num_gpu_blocks=128, debug_checks=True)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config), loaded=loaded)


def prompt(engine, question: str) -> list[int]:
    return engine.chat_format.render([{"role": "user", "content": question}])


def run(engine, requests, check_every_step=False):
    """Run requests to completion; returns {(request_id, index): (token_ids, text, last delta)}."""
    for request in requests:
        engine.add_request(request)
    results: dict = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None, out.error
            key = (out.request_id, out.delta.index)
            tokens, text, _ = results.get(key, ([], "", None))
            results[key] = (tokens + out.delta.token_ids, text + out.delta.text, out.delta)
        if check_every_step:
            engine.check_integrity()
    return results


def greedy(request_id, tokens, max_tokens=12, **kwargs):
    return GenerationRequest(request_id, tokens, SamplingParams(max_tokens, 0.0, **kwargs), NS)


def test_greedy_matches_transformers_generate(smollm2_fp32, smollm2_hf_fp32):
    engine = make_engine(smollm2_fp32, max_num_batched_tokens=64)  # forces chunked prefill
    lengths = [12, 5, 9, 16]
    requests = [
        greedy(f"q{i}", prompt(engine, q), n)
        for i, (q, n) in enumerate(zip(QUESTIONS, lengths, strict=True))
    ]
    results = run(engine, requests)
    stop_ids = engine.default_stop_ids
    for i, request in enumerate(requests):
        ids = torch.tensor([request.prompt_token_ids])
        with torch.no_grad():
            reference = smollm2_hf_fp32.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=lengths[i],
                do_sample=False,
                eos_token_id=sorted(stop_ids),
                pad_token_id=0,
            )[0, ids.shape[1] :].tolist()
        # transformers pads after a stop token; the engine stops there.
        for j, token in enumerate(reference):
            if token in stop_ids:
                reference = reference[: j + 1]
                break
        tokens, text, last = results[(f"q{i}", 0)]
        assert tokens == reference, (i, engine.tokenizer.decode(tokens))
        assert last.finish_reason == ("stop" if tokens[-1] in stop_ids else "length")
        assert last.metrics.completion_tokens == len(tokens)
        assert last.metrics.prompt_tokens == len(request.prompt_token_ids)
        assert text == engine.tokenizer.decode(
            [t for t in tokens if t not in stop_ids], skip_special_tokens=True
        )
    assert engine.cache_stats()["device"]["used"] == 0


def _conversation(engine, turns=4, max_tokens=8):
    """Returns each turn's output tokens and (cached prompt tokens, tokens computed before)."""
    history: list[int] = []
    computed = 0  # tokens of `history` whose KV an earlier turn wrote
    outputs, cached = [], []
    end_turn = engine.chat_format.tokenize("<|im_end|>\n")
    for turn in range(turns):
        new_turn = f"<|im_start|>user\n{QUESTIONS[turn]}<|im_end|>\n<|im_start|>assistant\n"
        if turn == 0:
            new_turn = "<|im_start|>system\nYou are terse.<|im_end|>\n" + new_turn
        tokens = history + engine.chat_format.tokenize(new_turn)
        result = run(engine, [greedy(f"t{turn}", tokens, max_tokens)])
        out_tokens, _, last = result[(f"t{turn}", 0)]
        outputs.append(out_tokens)
        cached.append((last.metrics.cached_prompt_tokens, computed))
        # The model saw the prompt and every output token but the last one.
        computed = len(tokens) + len(out_tokens) - 1
        if out_tokens[-1] != end_turn[0]:
            out_tokens = out_tokens + end_turn[:1]
        history = tokens + out_tokens + end_turn[1:]
    return outputs, cached


def test_multi_turn_prefix_cache_is_exact_and_reuses_the_whole_history(smollm2_fp32):
    with_cache, cached = _conversation(make_engine(smollm2_fp32))
    without_cache, uncached = _conversation(make_engine(smollm2_fp32, enable_prefix_cache=False))
    assert with_cache == without_cache
    assert all(hit == 0 for hit, _ in uncached)
    assert cached[0] == (0, 0)
    for hit, computed in cached[1:]:
        assert computed > 16
        assert hit == (computed // 16) * 16


def test_n_samples_equal_independent_runs_and_share_prompt_blocks(smollm2_fp32):
    engine = make_engine(smollm2_fp32)
    tokens = prompt(engine, QUESTIONS[1])
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=1234, n=3)
    engine.add_request(GenerationRequest("multi", tokens, params, NS))
    engine.step()  # prefill, then the fork
    seqs = engine._requests["multi"].seqs
    tables = [engine.cache.block_table(s.seq_id) for s in seqs]
    num_full = len(tokens) // 16
    prompt_blocks = {b for table in tables for b in table[:num_full]}
    assert len(seqs) == 3 and len(prompt_blocks) == num_full  # stored once
    results = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            key = out.delta.index
            results[key] = results.get(key, []) + out.delta.token_ids
    # The first tokens were sampled in the prefill step; gather them from the sequences.
    together = [s.output_token_ids for s in seqs]
    for i in range(3):
        single = make_engine(smollm2_fp32)
        alone = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=1234 + i)
        got = run(single, [GenerationRequest(f"s{i}", tokens, alone, NS)])[(f"s{i}", 0)][0]
        assert got == together[i]
    assert len({tuple(t) for t in together}) > 1  # different seeds really differ
    assert engine.cache_stats()["device"]["used"] == 0


def test_small_pool_evicts_swaps_preempts_and_stays_exact(smollm2_fp32):
    requests = lambda e: [  # noqa: E731
        greedy(f"r{i}", prompt(e, q), 12) for i, q in enumerate(QUESTIONS)
    ]
    big = make_engine(smollm2_fp32)
    expected = run(big, requests(big))
    # Blocks of 8: a ~37-token prompt takes 5 and grows to 7 while decoding, so two
    # admitted sequences outgrow 12 blocks and the newest is preempted.
    small = make_engine(smollm2_fp32, block_size=8, num_gpu_blocks=12, num_host_blocks=32)
    got = run(small, requests(small), check_every_step=True)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in expected.items()}
    stats = small.cache_stats()
    assert stats["num_preemptions"] > 0
    assert stats["device"]["used"] == 0
    assert stats["device"]["free"] + stats["device"]["evictable"] == 12
    assert stats["evictions"]["to_host"] > 0 and stats["swapped_out_blocks"] > 0


def test_request_that_can_never_fit_is_refused_at_submit(smollm2_fp32):
    engine = make_engine(smollm2_fp32, num_gpu_blocks=4, max_model_len=256)
    tokens = prompt(engine, QUESTIONS[0])
    with pytest.raises(RequestTooLargeError, match="blocks"):
        engine.add_request(greedy("big", tokens, max_tokens=200))
    with pytest.raises(RequestTooLargeError, match="context"):
        engine.add_request(greedy("long", list(range(10, 300)), max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(greedy("bad", tokens, max_tokens=0))
    assert not engine.has_unfinished_requests
    assert engine.cache_stats()["device"]["free"] == 4


def test_stop_string_and_abort(smollm2_fp32):
    engine = make_engine(smollm2_fp32)
    tokens = prompt(engine, QUESTIONS[0])
    results = run(engine, [greedy("s", tokens, 12, stop=("France",))])
    _, text, last = results[("s", 0)]
    assert last.finish_reason == "stop" and "France" not in text
    engine.add_request(greedy("x", tokens, 12))
    engine.step()
    assert engine.cache_stats()["device"]["used"] > 0
    (aborted,) = engine.abort_request("x")
    assert aborted.delta.finish_reason == "abort"
    assert engine.cache_stats()["device"]["used"] == 0
    assert engine.abort_request("x") == []
