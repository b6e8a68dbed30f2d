"""One request's failure ends that request alone (real SmolLM2, fp32, greedy).

Each test co-batches a poisoned request with three greedy ones and checks that
the three produce exactly the tokens of their solo runs, that the poisoned one
ends with a clear error (or, for a tiny temperature, does not fail at all), and
that the cache's invariants hold after every step with no block left in use.
The faults are injected into the real engine: a wrapper over the model's forward
pass that corrupts or refuses only the poisoned sequence's part of a step, or a
detokenizer of the poisoned sequence that raises.
"""

from __future__ import annotations

import pytest

from cache import Namespace
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine
from chatsvc.engine.sequence import Sequence, SequenceStatus
from chatsvc.protocol import EngineInternalError, GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow
NS = Namespace(tenant_salt=b"tenant-f", label="f")
HEALTHY = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
POISONED = "Why is the sky blue? Answer briefly."
MAX_TOKENS = 8


def make_engine(loaded) -> LLMEngine:
    # run() checks the cache's invariants after every step (debug_checks would check
    # after every mutation: slower, and the step boundary is what isolation promises).
    config = EngineConfig(dtype="fp32", block_size=16, num_gpu_blocks=128)
    return LLMEngine(config, loaded=loaded)


def request(engine, request_id: str, question: str, **sampling) -> GenerationRequest:
    tokens = engine.chat_format.render([{"role": "user", "content": question}])
    params = SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, **sampling})
    return GenerationRequest(request_id, tokens, params, NS)


def run(engine, requests, queued=False) -> tuple[dict[str, list[int]], dict[str, Exception]]:
    """Run to completion, checking the cache after every step: (tokens, errors) by id.

    ``queued``: the requests were already added.
    """
    for r in requests if not queued else ():
        engine.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    errors: dict[str, Exception] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.request_id not in errors, "no delta after a request's error"
            if out.error is not None:
                errors[out.request_id] = out.error
            else:
                tokens[out.request_id] += out.delta.token_ids
        engine.check_integrity()
    assert engine.cache_stats()["device"]["used"] == 0  # no block leaked
    return tokens, errors


@pytest.fixture(scope="module")
def solo(smollm2_fp32) -> dict[str, list[int]]:
    """Each request alone in the engine (one after another): the expected tokens."""
    engine = make_engine(smollm2_fp32)
    expected = {}
    for i, question in enumerate([*HEALTHY, POISONED]):
        tokens, errors = run(engine, [request(engine, f"h{i}", question)])
        assert not errors
        expected[f"h{i}"] = tokens[f"h{i}"]
    expected["poisoned"] = expected.pop(f"h{len(HEALTHY)}")
    return expected


def co_batched(engine, poisoned: GenerationRequest, first: bool = True):
    """The poisoned request with the three healthy ones, all queued before the first step.

    All four prompts start with the template's default system prompt, so the first
    one prefills alone while the others wait for those blocks (the scheduler's
    deferral); the other three prefill together in the next step. ``first``: the
    poisoned one prefills alone (and its failure must release the waiters), else
    it prefills beside two healthy ones and a decode.
    """
    healthy = [request(engine, f"h{i}", q) for i, q in enumerate(HEALTHY)]
    return [poisoned, *healthy] if first else [*healthy, poisoned]


def assert_healthy_as_alone(tokens, errors, solo) -> None:
    for i in range(len(HEALTHY)):
        assert f"h{i}" not in errors, errors.get(f"h{i}")
        assert tokens[f"h{i}"] == solo[f"h{i}"], i


def poisoned_seq(engine) -> Sequence | None:
    state = engine._requests.get("poisoned")
    return state.seqs[0] if state is not None else None


def logits_row(engine, batch) -> int | None:
    """The row of the poisoned sequence in this forward pass's logits, if it takes part."""
    seq = poisoned_seq(engine)
    if seq is None or seq.status is not SequenceStatus.RUNNING:
        return None
    size = engine.config.block_size
    table = engine.cache.block_table(seq.seq_id)
    last = seq.num_tokens - 1  # its newest token: the one whose logits are read
    slot = table[last // size] * size + last % size
    rows = (batch.slot_mapping[batch.logits_indices] == slot).nonzero().flatten().tolist()
    return rows[0] if rows else None


def wrap_forward(monkeypatch, engine, fault) -> list[int]:
    """Run ``fault(batch, logits, row)`` after every forward pass the poisoned sequence
    joins (``row``: its logits row); returns the batch sizes of those passes."""
    real = engine.model.forward
    sizes: list[int] = []

    def forward(batch, kv_pool):
        row = logits_row(engine, batch)
        if row is None:
            return real(batch, kv_pool)
        sizes.append(batch.num_seqs)
        return fault(batch, real, kv_pool, row)

    monkeypatch.setattr(engine.model, "forward", forward)
    return sizes


def test_a_tiny_temperature_fails_nobody(smollm2_fp32, solo):
    engine = make_engine(smollm2_fp32)
    tiny = request(engine, "poisoned", POISONED, temperature=1e-40, top_p=0.5, seed=9)
    tokens, errors = run(engine, co_batched(engine, tiny))
    assert not errors
    assert_healthy_as_alone(tokens, errors, solo)
    assert tokens["poisoned"] == solo["poisoned"]  # below the greedy line: greedy


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_fail_their_request_alone(smollm2_fp32, solo, monkeypatch, temperature):
    engine = make_engine(smollm2_fp32)

    def nan_row(batch, real, kv_pool, row):
        logits = real(batch, kv_pool).clone()  # the model's own is an inference tensor
        seq = poisoned_seq(engine)
        if len(seq.output_token_ids) >= 2:  # mid-answer, in a decode step
            logits[row, 100] = float("nan")
        return logits

    sizes = wrap_forward(monkeypatch, engine, nan_row)
    poisoned = request(engine, "poisoned", POISONED, temperature=temperature, seed=4)
    tokens, errors = run(engine, co_batched(engine, poisoned))
    assert max(sizes) == 4  # it really shared steps with the other three
    assert isinstance(errors["poisoned"], EngineInternalError)
    assert "NaN or infinity" in str(errors["poisoned"])
    assert len(tokens["poisoned"]) == 2  # the tokens before the bad row still went out
    assert_healthy_as_alone(tokens, errors, solo)


def test_a_detokenizer_error_fails_its_request_alone(smollm2_fp32, solo):
    engine = make_engine(smollm2_fp32)
    requests = co_batched(engine, request(engine, "poisoned", POISONED))
    for r in requests:
        engine.add_request(r)
    detokenizer = poisoned_seq(engine).detokenizer
    real_add = detokenizer.add_token
    seen: list[int] = []

    def add_token(token_id: int) -> str:
        seen.append(token_id)
        if len(seen) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real_add(token_id)

    detokenizer.add_token = add_token
    tokens, errors = run(engine, requests, queued=True)
    error = errors["poisoned"]
    assert isinstance(error, EngineInternalError) and "stop handling" in str(error)
    assert isinstance(error.__cause__, UnicodeDecodeError)
    assert len(tokens["poisoned"]) == 2
    assert_healthy_as_alone(tokens, errors, solo)


@pytest.mark.parametrize("when", ["own-prefill", "shared-prefill", "decode"])
def test_a_model_step_refusing_one_request_fails_it_alone(smollm2_fp32, solo, monkeypatch, when):
    engine = make_engine(smollm2_fp32)

    def refuse(batch, real, kv_pool, row):
        seq = poisoned_seq(engine)
        if when != "decode" or len(seq.output_token_ids) >= 2:
            raise ValueError("the kernel refuses this sequence's shapes")
        return real(batch, kv_pool)

    sizes = wrap_forward(monkeypatch, engine, refuse)
    poisoned = request(engine, "poisoned", POISONED)
    tokens, errors = run(engine, co_batched(engine, poisoned, first=when != "shared-prefill"))
    # The step failed, then each sequence ran alone: the poisoned one failed again
    # alone and was the only one ended.
    assert sizes[-2:] == [1 if when == "own-prefill" else 4, 1]
    error = errors["poisoned"]
    assert isinstance(error, EngineInternalError) and "forward pass" in str(error)
    assert isinstance(error.__cause__, ValueError)
    assert len(tokens["poisoned"]) == (2 if when == "decode" else 0)
    assert_healthy_as_alone(tokens, errors, solo)
    # Nothing the failed passes wrote was indexed: a fresh request of the poisoned
    # prompt now runs exactly as it did alone.
    monkeypatch.undo()
    again, errors = run(engine, [request(engine, "again", POISONED)])
    assert not errors and again["again"] == solo["poisoned"]


def test_a_step_failing_only_as_a_batch_is_retried_once_per_plan(smollm2_fp32, monkeypatch):
    # Every batched pass fails, every single one passes: the step is re-run one
    # sequence at a time and nobody fails. The copy-on-write of the partial block
    # the two samples (n = 2) share is planned once and must run once: a second run
    # after the retry wrote that block would overwrite the retry's KV.
    engine = make_engine(smollm2_fp32)
    plans: list[object] = []
    real_plans = engine.runner.execute_plans

    def execute_plans(step_plans, io):
        plans.extend(step_plans)
        return real_plans(step_plans, io)

    monkeypatch.setattr(engine.runner, "execute_plans", execute_plans)
    calls = {"n": 0}
    real_forward = engine.model.forward

    def flaky(batch, kv_pool):
        calls["n"] += 1
        if batch.num_seqs > 1:  # every batched pass fails once; alone they pass
            raise RuntimeError("a transient failure of the whole step")
        return real_forward(batch, kv_pool)

    monkeypatch.setattr(engine.model, "forward", flaky)
    params = dict(temperature=0.7, seed=21, n=2)
    tokens, errors = run(engine, [request(engine, "forked", POISONED, **params)])
    assert not errors
    num_copies = sum(len(p.copies) for p in plans)
    monkeypatch.undo()
    reference = make_engine(smollm2_fp32)
    reference_plans: list[object] = []
    real_reference = reference.runner.execute_plans

    def record(step_plans, io):
        reference_plans.extend(step_plans)
        return real_reference(step_plans, io)

    monkeypatch.setattr(reference.runner, "execute_plans", record)
    expected, _ = run(reference, [request(reference, "forked", POISONED, **params)])
    assert num_copies == sum(len(p.copies) for p in reference_plans) > 0
    assert tokens == expected


def test_sampling_rows_of_healthy_requests_keep_their_draws(smollm2_fp32, monkeypatch):
    # Sampled (seeded) neighbours, not just greedy ones, draw the same tokens when a
    # co-batched request's row is bad: a failed row advances nobody's generator.
    def sampled(engine, rid, question, seed):
        return request(engine, rid, question, temperature=0.9, top_p=0.95, seed=seed)

    clean = make_engine(smollm2_fp32)
    expected, _ = run(clean, [sampled(clean, f"s{i}", q, 30 + i) for i, q in enumerate(HEALTHY)])
    engine = make_engine(smollm2_fp32)

    def inf_row(batch, real, kv_pool, row):
        logits = real(batch, kv_pool).clone()
        logits[row] = float("inf")
        return logits

    sizes = wrap_forward(monkeypatch, engine, inf_row)
    # Queued last, it prefills beside the other two prefills and the first's decode.
    requests = [sampled(engine, f"s{i}", q, 30 + i) for i, q in enumerate(HEALTHY)]
    requests.append(request(engine, "poisoned", POISONED, temperature=0.9, seed=1))
    tokens, errors = run(engine, requests)
    assert sizes == [4]
    assert set(errors) == {"poisoned"}
    assert {k: v for k, v in tokens.items() if k != "poisoned"} == expected
