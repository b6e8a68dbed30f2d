"""Beam search in the engine on the real SmolLM2 model (fp32).

Its answers equal transformers' ``generate(num_beams=...)``; its beams share the
prompt's blocks (stored once) and hold no more than the bound while the cache's
invariants hold after every step; nothing leaks when beams are pruned, the search
ends or is aborted; preemption takes a search whole and it gives the same answer;
a failing search fails alone.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from cache import Namespace
from chatsvc.engine.beam_search import peak_blocks
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine
from chatsvc.protocol import (
    EngineInternalError,
    GenerationRequest,
    RequestTooLargeError,
    RequestValidationError,
    SamplingParams,
)

pytestmark = pytest.mark.slow
NS = Namespace(tenant_salt=b"tenant-b", label="b")
BS = 16
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


def make_engine(loaded, **overrides) -> LLMEngine:
    config = dict(dtype="fp32", block_size=BS, num_gpu_blocks=128, debug_checks=True)
    config.update(overrides)
    return LLMEngine(EngineConfig(**config), loaded=loaded)


def prompt(engine, question: str) -> list[int]:
    return engine.chat_format.render([{"role": "user", "content": question}])


def beams(request_id, tokens, width, max_tokens=10, ns=NS, **fields) -> GenerationRequest:
    params = SamplingParams(max_tokens, 0.0, beam_width=width, **fields)
    return GenerationRequest(request_id, tokens, params, ns)


def greedy(request_id, tokens, max_tokens, ns=NS) -> GenerationRequest:
    return GenerationRequest(request_id, tokens, SamplingParams(max_tokens, 0.0), ns)


def run(engine, requests, each_step=None, later=()) -> dict:
    """Run to completion: {(request_id, index): last delta, with every token and all the
    text}; ``each_step()`` after every step; ``later`` requests join after the first."""
    for request in requests:
        engine.add_request(request)
    results: dict = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None, out.error
            key = (out.request_id, out.delta.index)
            before = results.get(key)
            if before is not None:
                out = replace(
                    out.delta,
                    token_ids=before.token_ids + out.delta.token_ids,
                    text=before.text + out.delta.text,
                )
            results[key] = out if before is not None else out.delta
        engine.check_integrity()
        if each_step is not None:
            each_step()
        for request in later:
            engine.add_request(request)
        later = ()
    return results


def transformers_beams(hf, tokens, stop_ids, width, max_tokens, **generate) -> list[list[int]]:
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=sorted(stop_ids),
            pad_token_id=0,
            **generate,
        )
    answers = []
    for row in out[:, ids.shape[1] :].tolist():
        # transformers pads a hypothesis that ended early; the engine's ends at its stop.
        end = next((i + 1 for i, token in enumerate(row) if token in stop_ids), len(row))
        answers.append(row[:end])
    return answers


# (question, width, max_tokens, length_penalty, early_stopping, min_tokens): short
# answers that end in the stop token mixed with ones cut at max_tokens; a negative
# and a large length penalty; near-tied scores (the third question with width 3).
CASES = [
    (1, 4, 10, 1.0, False, 0),
    (2, 3, 10, 0.6, True, 0),
    (0, 2, 10, 2.0, "never", 3),
    (0, 4, 14, -0.5, False, 0),
]


def test_every_beam_equals_transformers_generate(smollm2_fp32, smollm2_hf_fp32):
    engine = make_engine(smollm2_fp32)
    stop_ids = engine.default_stop_ids
    finish_reasons = set()
    for case, (q, width, max_tokens, penalty, early, min_tokens) in enumerate(CASES):
        tokens = prompt(engine, QUESTIONS[q])
        request = beams(
            f"c{case}",
            tokens,
            width,
            max_tokens,
            n=width,
            length_penalty=penalty,
            early_stopping=early,
            min_tokens=min_tokens,
        )
        results = run(engine, [request])
        reference = transformers_beams(
            smollm2_hf_fp32,
            tokens,
            stop_ids,
            width,
            max_tokens,
            length_penalty=penalty,
            early_stopping=early,
            min_new_tokens=min_tokens or None,
        )
        answers = [results[(f"c{case}", i)] for i in range(width)]
        assert [a.token_ids for a in answers] == reference, case
        for answer in answers:
            ended = answer.token_ids[-1] in stop_ids
            assert answer.finish_reason == ("stop" if ended else "length")
            finish_reasons.add(answer.finish_reason)
            assert answer.metrics.completion_tokens == len(answer.token_ids)
            assert answer.metrics.prompt_tokens == len(tokens)
            assert answer.text == engine.tokenizer.decode(
                [t for t in answer.token_ids if t not in stop_ids], skip_special_tokens=True
            )
        assert engine.cache_stats()["device"]["used"] == 0
    assert finish_reasons == {"stop", "length"}


def long_prompt(engine) -> list[int]:
    system = "You answer questions about the sea, in plain words. " * 18
    return engine.chat_format.render(
        [{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[1]}]
    )


def test_beams_store_the_prompt_once_and_release_pruned_blocks_at_once(smollm2_fp32):
    width, max_tokens = 4, 17
    engine = make_engine(smollm2_fp32)
    tokens = long_prompt(engine)
    shared = len(tokens) // BS
    assert shared >= 12
    refcounts = engine.cache.tiers.device.refcounts
    held: list[int] = []

    def check_beams():
        state = engine._requests.get("b")
        if state is None:
            return
        live = state.beams.beams
        # The cache holds exactly the running beams: a pruned one is gone at once.
        assert set(engine.cache.seq_ids) == {b.seq_id for b in live}
        held.append(engine.cache_stats()["device"]["used"])
        if len(live) == width:
            tables = [engine.cache.block_table(b.seq_id) for b in live]
            assert len({tuple(t[:shared]) for t in tables}) == 1  # one copy of the prompt
            assert all(refcounts[block] == width for block in tables[0][:shared])
            # They advance together: one decode each per step.
            assert len({b.num_computed_tokens for b in live}) == 1

    request = beams("b", tokens, width, max_tokens, n=2, ignore_eos=True)
    results = run(engine, [request], check_beams)
    assert [results[("b", i)].finish_reason for i in range(2)] == ["length", "length"]
    stats = engine.cache_stats()
    # Nothing leaks, and only the prompt's blocks stay cached (no pruned beam's).
    assert stats["device"]["used"] == 0 and stats["indexed_blocks"] == shared
    bound = math.ceil(len(tokens) / BS) + width * math.ceil(max_tokens / BS) + width
    assert max(held) <= peak_blocks(len(tokens), len(tokens) + max_tokens, width, BS) <= bound

    # The same work as four independent requests (four other tenants: nothing shared,
    # not even the search's cached prompt).
    held_apart: list[int] = []
    tenants = [Namespace(tenant_salt=f"t{i}".encode(), label=f"t{i}") for i in range(width)]
    run(
        engine,
        [greedy(f"g{i}", tokens, max_tokens, ns) for i, ns in enumerate(tenants)],
        lambda: held_apart.append(engine.cache_stats()["device"]["used"]),
    )
    assert max(held_apart) >= width * shared
    assert max(held) < max(held_apart) - (width - 2) * shared


def test_abort_mid_search_frees_every_beam(smollm2_fp32):
    engine = make_engine(smollm2_fp32)
    engine.add_request(beams("a", prompt(engine, QUESTIONS[1]), 4, 12, n=3))
    for _ in range(3):
        assert engine.step() == []  # nothing is streamed before the search ends
    assert len(engine._requests["a"].beams.beams) == 4
    outputs = engine.abort_request("a")
    assert [(o.delta.index, o.delta.finish_reason) for o in outputs] == [
        (0, "abort"),
        (1, "abort"),
        (2, "abort"),
    ]
    assert engine.cache.seq_ids == [] and engine.cache_stats()["device"]["used"] == 0
    engine.check_integrity()


def test_a_search_that_cannot_fit_or_run_is_refused_at_submit(smollm2_fp32):
    engine = make_engine(smollm2_fp32, num_gpu_blocks=24, max_num_batched_tokens=4)
    tokens = prompt(engine, QUESTIONS[0])  # 2 full blocks and a partial one
    with pytest.raises(RequestTooLargeError, match="beam search of width 4 .* at its peak"):
        engine.add_request(beams("big", tokens, 4, max_tokens=90))  # 2 + 4 x 6 > 24
    with pytest.raises(RequestValidationError, match="tokens a step computes"):
        engine.add_request(beams("wide", tokens, 5))
    with pytest.raises(RequestValidationError, match="temperature must be 0"):
        engine.add_request(GenerationRequest("t", tokens, SamplingParams(8, 0.5, beam_width=2), NS))
    assert not engine.has_unfinished_requests and engine.cache.seq_ids == []


def test_a_preempted_search_starts_over_and_gives_the_same_answer(smollm2_fp32):
    def answers(engine):
        """Three greedy answers running, then a search: the newest, so the victim."""
        first = [
            GenerationRequest(
                f"g{i}", prompt(engine, q), SamplingParams(24, 0.0, ignore_eos=True), NS
            )
            for i, q in enumerate(QUESTIONS)
        ]
        search = beams("b", prompt(engine, QUESTIONS[0]), 4, 16, n=4, length_penalty=0.5)
        restarts = []
        real_restart = None

        def spy():
            nonlocal real_restart
            state = engine._requests.get("b")
            if state is not None and real_restart is None:
                real_restart = state.beams.restart

                def restart():
                    restarts.append(len(state.beams.beams))
                    return real_restart()

                state.beams.restart = restart

        results = run(engine, first, spy, later=[search])
        assert engine.cache_stats()["device"]["used"] == 0
        return {key: delta.token_ids for key, delta in results.items()}, restarts

    expected, restarts = answers(make_engine(smollm2_fp32))
    assert restarts == []
    # 14 blocks: the greedy answers grow into their third and fourth blocks while the
    # search's four beams need a block each at once; an older answer's growth preempts
    # the search (the newest) as a whole, and it starts over once there is room.
    got, restarts = answers(make_engine(smollm2_fp32, num_gpu_blocks=14))
    assert restarts == [4]
    assert got == expected


def test_a_failing_search_fails_alone(smollm2_fp32, monkeypatch):
    engine = make_engine(smollm2_fp32, debug_checks=False)
    alone = run(engine, [greedy("g", prompt(engine, QUESTIONS[2]), 8)])[("g", 0)].token_ids
    real = engine.model.forward

    def forward(batch, kv_pool):
        logits = real(batch, kv_pool)
        state = engine._requests.get("b")
        if state is None or len(state.beams.beams) < 4:
            return logits
        logits = logits.clone()
        logits[:-1, 7] = float("nan")  # every row but the last (the greedy request's)
        return logits

    monkeypatch.setattr(engine.model, "forward", forward)
    engine.add_request(beams("b", prompt(engine, QUESTIONS[1]), 4, 8))
    engine.step()  # the search's prefill alone: it forks into four beams
    engine.add_request(greedy("g", prompt(engine, QUESTIONS[2]), 8))
    errors, tokens = {}, []
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            else:
                tokens += out.delta.token_ids
        engine.check_integrity()
    assert isinstance(errors.pop("b"), EngineInternalError) and not errors
    assert tokens == alone
    assert engine.cache_stats()["device"]["used"] == 0


def test_a_search_whose_answer_cannot_be_detokenized_fails_alone(smollm2_fp32, monkeypatch):
    import chatsvc.engine.engine as engine_module

    engine = make_engine(smollm2_fp32, debug_checks=False)
    alone = run(engine, [greedy("g", prompt(engine, QUESTIONS[2]), 6)])[("g", 0)].token_ids
    engine.add_request(greedy("g", prompt(engine, QUESTIONS[2]), 6))  # its text: as before

    class Broken(engine_module.IncrementalDetokenizer):
        def add_token(self, token_id: int) -> str:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    monkeypatch.setattr(engine_module, "IncrementalDetokenizer", Broken)
    engine.add_request(beams("b", prompt(engine, QUESTIONS[1]), 2, 4))
    errors, tokens = {}, []
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.error is not None:
                errors[out.request_id] = out.error
            else:
                tokens += out.delta.token_ids
    error = errors.pop("b")
    assert isinstance(error, EngineInternalError) and "beam search" in str(error)
    assert isinstance(error.__cause__, UnicodeDecodeError) and not errors
    assert tokens == alone
    assert engine.cache_stats()["device"]["used"] == 0
    engine.check_integrity()
