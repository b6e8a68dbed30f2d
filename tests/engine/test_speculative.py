"""Speculative decoding (issue 30) against the real model: the output is the output
without it, the cache never keeps a rejected token, a failure stays its request's."""

from __future__ import annotations

import pytest

from cache import Namespace
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine
from chatsvc.engine.loader import load_model
from chatsvc.kv_metrics import TierTrafficCollector
from chatsvc.protocol import EngineInternalError, GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow
NS = Namespace(tenant_salt=b"tenant-s", label="s")
CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
ANSWER = "Paris is the capital of France. It lies on the Seine and is known for the Louvre."
CHATS = [
    [{"role": "user", "content": "Add type hints to this code and return all of it:\n" + CODE}],
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "Repeat your previous answer exactly, word for word."},
    ],
    [
        {"role": "user", "content": "Fix the typo and return the sentence: The quick brwn fox."},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


def make_engine(loaded, mode: str, dtype: str = "fp32") -> LLMEngine:
    config = EngineConfig(
        dtype=dtype, block_size=16, num_gpu_blocks=96, debug_checks=True, speculative=mode
    )
    return LLMEngine(config, loaded=loaded)


def run(engine: LLMEngine, requests, each_step=None) -> dict:
    """Every request to its end: {(id, index): (tokens, text, finish, logprobs) or error}."""
    for request in requests:
        engine.add_request(request)
    results: dict = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.error is not None:
                results[(out.request_id, "error")] = out.error
                continue
            d = out.delta
            tokens, text, _, scores = results.get((out.request_id, d.index), ([], "", None, []))
            results[(out.request_id, d.index)] = (
                tokens + d.token_ids,
                text + d.text,
                d.finish_reason,
                scores + list(d.logprobs or ()),
            )
        engine.check_integrity()
        if each_step is not None:
            each_step(engine)
    # Nothing leaked: no sequence left, every device block free or cached, none held.
    assert not engine.cache.seq_ids
    assert not any(engine.cache.tiers.device.refcounts)
    return results


def chats(engine, params: SamplingParams, conversations=CHATS) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"c{i}", engine.chat_format.render(chat), params, NS)
        for i, chat in enumerate(conversations)
    ]


def indexed(engine) -> set[bytes]:
    return set(engine.cache.tiers.index.nodes)


def greedy_on_and_off(loaded, dtype: str, modes) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0)
    reference = make_engine(loaded, "off", dtype)
    expected = run(reference, chats(reference, params))
    assert "speculative" not in reference.cache_stats()
    for mode in modes:
        engine = make_engine(loaded, mode, dtype)
        assert run(engine, chats(engine, params)) == expected, mode
        stats = engine.speculator.stats()
        # The rewrite turns do speculate, and most of what they propose is kept.
        assert stats["accepted_tokens"] > 10 and stats["acceptance_rate"] > 0.3, stats
        # The operator sees the same counts: /admin/cache and /metrics.
        assert engine.cache_stats()["speculative"] == stats
        exported = {
            sample.labels["outcome"]: sample.value
            for family in TierTrafficCollector(engine.cache_stats).collect()
            if family.name == "chatsvc_speculative_tokens"
            for sample in family.samples
        }
        assert exported == {
            "proposed": stats["proposed_tokens"],
            "accepted": stats["accepted_tokens"],
        }
        # The same blocks indexed as without speculation: only verified ones.
        assert indexed(engine) == indexed(reference), mode


def test_greedy_output_and_index_are_the_same_with_speculation_fp32(smollm2_fp32):
    greedy_on_and_off(smollm2_fp32, "fp32", ["ngram", "suffix"])


def test_greedy_output_and_index_are_the_same_with_speculation_bf16():
    greedy_on_and_off(load_model("smollm2", dtype="bf16"), "bf16", ["ngram"])


def test_sampling_options_behave_as_without_speculation(smollm2_fp32):
    repeat = [CHATS[0]]

    def requests(engine):
        cases = [
            SamplingParams(max_tokens=30, temperature=0.0, stop=("return",)),
            SamplingParams(max_tokens=7, temperature=0.0),
            SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3),
            SamplingParams(max_tokens=30, temperature=0.0, frequency_penalty=0.5, min_tokens=25),
            SamplingParams(max_tokens=30, temperature=0.0, logprobs=2),
            SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(1177,)),
            SamplingParams(max_tokens=30, temperature=0.4, seed=7, n=2, logprobs=1),
            SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=3),
        ]
        out = []
        for i, params in enumerate(cases):
            (request,) = chats(engine, params, repeat)
            out.append(GenerationRequest(f"p{i}", request.prompt_token_ids, params, NS))
        return out

    reference = make_engine(smollm2_fp32, "off")
    expected = run(reference, requests(reference))
    engine = make_engine(smollm2_fp32, "ngram")
    assert run(engine, requests(engine)) == expected
    assert engine.speculator.stats()["accepted_tokens"] > 10
    assert expected[("p1", 0)][2] == "length" and len(expected[("p1", 0)][0]) == 7


def test_a_request_whose_verification_fails_fails_alone(smollm2_fp32, monkeypatch):
    params = SamplingParams(max_tokens=30, temperature=0.0)
    engine = make_engine(smollm2_fp32, "ngram")
    alone = run(engine, chats(engine, params)[:1])
    engine = make_engine(smollm2_fp32, "ngram")
    forward = engine.runner.forward

    def poisoned(items, cache):
        logits = forward(items, cache)
        row = 0
        for item in items:  # the verification rows of request c1 turn NaN
            if item.draft and item.seq.request.request_id == "c1":
                logits[row : row + item.num_rows] = float("nan")
            row += item.num_rows
        return logits

    monkeypatch.setattr(engine.runner, "forward", poisoned)
    results = run(engine, chats(engine, params)[:2])
    assert isinstance(results[("c1", "error")], EngineInternalError)
    assert results[("c0", 0)] == alone[("c0", 0)]


def test_proposals_never_evict_a_cached_block(smollm2_fp32):
    """In a pool too small for both turns, the second evicts cached blocks of the first:
    as many with speculation as without (proposals take free blocks only), and its
    output is the same."""
    params = SamplingParams(max_tokens=40, temperature=0.0)
    results, dropped = [], []
    for mode in ("off", "ngram"):
        config = EngineConfig(dtype="fp32", num_gpu_blocks=8, debug_checks=True, speculative=mode)
        engine = LLMEngine(config, loaded=smollm2_fp32)
        run(engine, chats(engine, params, CHATS[3:]))
        results.append(run(engine, chats(engine, params, CHATS[:1])))
        dropped.append(engine.cache.stats_snapshot()["evictions"]["dropped"])
    assert results[0] == results[1]
    assert dropped[0] == dropped[1] > 0
    assert engine.speculator.stats()["accepted_tokens"] > 5
