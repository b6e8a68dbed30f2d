"""Admission is fair between tenants: scheduler against a real KVCacheManager, no model.

A step is run the way the engine runs one: KV "computation" is update_from_step,
and a request with n > 1 forks its other samples (cache.fork, add_forked) once
its prompt is computed.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from cache import KVCacheManager, Namespace
from chatsvc.engine.detokenizer import IncrementalDetokenizer
from chatsvc.engine.fairness import StepShares, step_cost
from chatsvc.engine.scheduler import Scheduler, SchedulerConfig
from chatsvc.engine.sequence import Sequence, SequenceStatus
from chatsvc.protocol import GenerationRequest, SamplingParams

BS = 4
_ids = itertools.count()
_tokens = itertools.count(1000)


class _Tok:
    def decode(self, token_ids, skip_special_tokens=True):
        return " ".join(map(str, token_ids))


def _sequence(request: GenerationRequest, index: int) -> Sequence:
    detok = IncrementalDetokenizer(_Tok(), [])
    return Sequence(next(_ids), request, index, list(request.prompt_token_ids), detok, None)


def submit(
    sched, tenant: str, *, max_tokens=1, n=1, prompt_len=6, prefix=(), prompt_logprobs=None
) -> Sequence:
    """One request of ``tenant`` with a prompt no other request shares (but ``prefix``,
    which it starts with)."""
    namespace = Namespace(tenant_salt=tenant.encode(), label=tenant)
    prompt = [*prefix, *(next(_tokens) for _ in range(prompt_len))]
    sampling = SamplingParams(max_tokens=max_tokens, n=n, prompt_logprobs=prompt_logprobs)
    request = GenerationRequest(f"r{next(_ids)}", prompt, sampling, namespace, {"tenant": tenant})
    seq = _sequence(request, 0)
    if prompt_logprobs is not None:
        seq.prompt_logprobs = [None]  # as the engine makes it (LLMEngine._new_sequence)
    sched.add(seq)
    return seq


def make(max_num_seqs, num_blocks=512, budget=4096):
    cache = KVCacheManager(num_blocks, BS, debug_checks=True)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    return cache, Scheduler(cache, config)


def has_work(sched: Scheduler) -> bool:
    return bool(sched.waiting or sched.running)


def step(sched, cache):
    """One step; returns the sequences admitted in it, in admission order."""
    before = {seq.seq_id for seq in sched.running}
    out = sched.schedule()
    admitted = [item.seq for item in out.scheduled if item.seq.seq_id not in before]
    sched.update_from_step(out.scheduled)
    for item in out.scheduled:
        seq = item.seq
        if not item.completes:
            continue
        samples = [seq]
        if seq.sample_index == 0 and not seq.output_token_ids:
            for index in range(1, seq.sampling.n):
                child = _sequence(seq.request, index)
                cache.fork(seq.seq_id, child.seq_id)
                sched.add_forked(child)
                samples.append(child)
        for sample in samples:
            sample.append_token(7, 0.0)
            if len(sample.output_token_ids) >= sample.sampling.max_tokens:
                sample.status = SequenceStatus.FINISHED
                sched.remove(sample)
    cache.check_integrity()
    return admitted


def tenant_of(seq: Sequence) -> str:
    return seq.request.labels["tenant"]


def tenants(seqs) -> list[str]:
    return [tenant_of(seq) for seq in seqs]


def run_to_completion(sched, cache, max_steps=10_000) -> None:
    for _ in range(max_steps):
        if not has_work(sched):
            return
        step(sched, cache)
    raise AssertionError("the scheduler did not finish its work")


def test_a_second_tenant_is_admitted_in_the_next_step_behind_a_long_queue():
    cache, sched = make(max_num_seqs=4)
    for _ in range(40):
        submit(sched, "a")
    assert tenants(step(sched, cache)) == ["a"] * 4  # alone, "a" takes every slot
    late = submit(sched, "b")
    # 36 of a's sequences are ahead of it in the queue; it is admitted at once anyway.
    admitted = step(sched, cache)
    assert late in admitted
    assert sorted(tenants(admitted)) == ["a", "a", "a", "b"]
    run_to_completion(sched, cache)


def test_a_lone_tenant_still_gets_every_slot():
    cache, sched = make(max_num_seqs=4)
    seqs = [submit(sched, "a", max_tokens=10) for _ in range(6)]
    step(sched, cache)
    assert sched.running == seqs[:4]
    run_to_completion(sched, cache)
    assert all(len(seq.output_token_ids) == 10 for seq in seqs)


def test_two_tenants_with_long_queues_share_the_slots():
    cache, sched = make(max_num_seqs=4)
    for tenant in ("a", "b"):
        for _ in range(10):
            submit(sched, tenant, max_tokens=5)
    step(sched, cache)
    assert sorted(tenants(sched.running)) == ["a", "a", "b", "b"]
    # As slots free up, each one goes to the tenant holding fewer.
    for _ in range(30):
        step(sched, cache)
        running = tenants(sched.running)
        if sched.waiting and {tenant_of(seq) for seq in sched.waiting} == {"a", "b"}:
            assert abs(running.count("a") - running.count("b")) <= 1, running
    run_to_completion(sched, cache)


def test_n_samples_count_as_n_slots_so_many_streams_cannot_fill_them_all():
    # One tenant's 8 streams at n=8 used to be admitted all at once (the cap counted
    # only the first sample of each): 64 sequences while another tenant waited.
    cache, sched = make(max_num_seqs=16)
    streams = [submit(sched, "a", n=8, max_tokens=20) for _ in range(8)]
    other = submit(sched, "b", max_tokens=20)
    admitted = step(sched, cache)
    assert other in admitted
    assert len(sched.running) <= 16
    assert sorted(tenants(sched.running)) == ["a"] * 8 + ["b"]
    for _ in range(5):
        step(sched, cache)
        assert len(sched.running) <= 16
    run_to_completion(sched, cache)
    assert all(len(seq.output_token_ids) == 20 for seq in [*streams, other])


def test_a_request_with_more_samples_than_slots_runs_alone():
    cache, sched = make(max_num_seqs=4)
    wide = submit(sched, "a", n=6, max_tokens=3)
    small = submit(sched, "b", max_tokens=3)
    assert step(sched, cache) == [wide]  # nothing runs: it may go, rather than never
    assert len(sched.running) == 6 and small.status is SequenceStatus.WAITING
    run_to_completion(sched, cache)
    assert len(small.output_token_ids) == 3


def test_within_a_tenant_the_longest_cached_prefix_still_goes_first():
    cache, sched = make(max_num_seqs=2)
    namespace = Namespace(tenant_salt=b"a", label="a")
    warm_prompt = list(range(300, 316))

    def request(prompt):
        req = GenerationRequest(
            f"r{next(_ids)}", prompt, SamplingParams(max_tokens=1), namespace, {"tenant": "a"}
        )
        seq = _sequence(req, 0)
        sched.add(seq)
        return seq

    request(warm_prompt)
    step(sched, cache)
    cold = request(list(range(900, 916)))
    other = submit(sched, "b")
    hot = request([*warm_prompt, 1, 2])
    assert step(sched, cache) == [hot, other]
    assert hot.num_cached_tokens == 16
    assert step(sched, cache) == [cold]


_requests = st.tuples(
    st.sampled_from(["a", "b", "c"]),
    st.integers(1, 3),  # n
    st.integers(1, 6),  # max_tokens
    st.integers(1, 12),  # prompt length
)


@given(
    requests=st.lists(_requests, min_size=1, max_size=12),
    max_num_seqs=st.integers(1, 5),
    num_blocks=st.integers(12, 24),
)
@settings(max_examples=60, deadline=None)
def test_every_request_finishes_and_the_cap_holds(requests, max_num_seqs, num_blocks):
    # Small pools force preemptions; forks, preemptions and fairness together must
    # never stall, and only a request wider than the cap may run past it (alone).
    cache, sched = make(max_num_seqs, num_blocks=num_blocks, budget=16)
    parents = [
        submit(sched, tenant, n=n, max_tokens=max_tokens, prompt_len=length)
        for tenant, n, max_tokens, length in requests
    ]
    for _ in range(2_000):
        if not has_work(sched):
            break
        step(sched, cache)
        running_requests = {seq.request.request_id for seq in sched.running}
        assert len(sched.running) <= max_num_seqs or len(running_requests) == 1
    assert not has_work(sched)
    for parent in parents:
        assert len(parent.output_token_ids) == parent.sampling.max_tokens
    assert cache.stats_snapshot()["device"]["used"] == 0


# --- the step's token budget, split between tenants (StepShares) ---------------------


def tokens_by_tenant(out) -> dict[str, int]:
    used: dict[str, int] = {}
    for item in out.scheduled:
        used[tenant_of(item.seq)] = used.get(tenant_of(item.seq), 0) + item.num_new_tokens
    return used


def one_step(sched, cache, check=True):
    """Like ``step``, but returns the SchedulerOutput (sampling as ``step`` does)."""
    out = sched.schedule()
    sched.update_from_step(out.scheduled)
    for item in out.scheduled:
        if item.completes:
            item.seq.append_token(7, 0.0)
            if len(item.seq.output_token_ids) >= item.seq.sampling.max_tokens:
                item.seq.status = SequenceStatus.FINISHED
                sched.remove(item.seq)
    if check:
        cache.check_integrity()
    return out


def test_a_tenant_with_many_decodes_and_long_prompts_gets_half_the_step_beside_another():
    cache, sched = make(max_num_seqs=64, budget=64)
    # The attacker: 40 streams decoding, then 4 long prompts arriving.
    streams = [submit(sched, "attacker", max_tokens=200, prompt_len=4) for _ in range(40)]
    while any(not s.output_token_ids for s in streams):
        one_step(sched, cache)
    for _ in range(4):
        submit(sched, "attacker", max_tokens=200, prompt_len=400)
    witness = submit(sched, "witness", max_tokens=20, prompt_len=6)
    witness_steps = 0
    while witness.status is not SequenceStatus.FINISHED:
        out = one_step(sched, cache)
        used = tokens_by_tenant(out)
        assert used.get("attacker", 0) <= 32, used  # half of the 64-token budget
        # The witness computes in every step until it finishes: its gap is one step.
        assert used.get("witness", 0) >= 1
        witness_steps += 1
    assert witness_steps == 20  # its prompt in one step, then one decode a step


def test_the_attacker_takes_the_whole_step_without_the_share():
    cache = KVCacheManager(512, BS, debug_checks=True)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=64, tenant_step_share=False)
    sched = Scheduler(cache, config)
    for _ in range(4):
        submit(sched, "attacker", max_tokens=50, prompt_len=400)
    submit(sched, "witness", max_tokens=20, prompt_len=6)
    one_step(sched, cache)
    out = one_step(sched, cache)
    assert tokens_by_tenant(out).get("attacker") == 64 - tokens_by_tenant(out).get("witness", 0)
    assert tokens_by_tenant(out)["attacker"] > 32  # the share test above would fail here


def test_a_lone_tenant_still_gets_the_whole_budget():
    cache, sched = make(max_num_seqs=64, budget=64)
    for _ in range(3):
        submit(sched, "solo", max_tokens=4, prompt_len=100)
    assert tokens_by_tenant(one_step(sched, cache)) == {"solo": 64}


def test_decodes_left_out_by_the_share_go_first_next_step():
    cache, sched = make(max_num_seqs=64, budget=32)
    streams = [submit(sched, "attacker", max_tokens=100, prompt_len=1) for _ in range(12)]
    one_step(sched, cache)  # all 12 prompts
    submit(sched, "witness", max_tokens=100, prompt_len=1)
    one_step(sched, cache)  # the witness's prompt beside 8 attacker decodes
    # 12 attacker decodes of 2 tokens' cost each (a token and its logits row), a share
    # of 16 a step: 8 decode a step, and none waits more than one step.
    assert step_cost(1, 3, logit_rows=1) == 2
    last_token_step = {s.seq_id: 0 for s in streams}
    for number in range(1, 9):
        before = {s.seq_id: len(s.output_token_ids) for s in streams}
        out = one_step(sched, cache)
        assert tokens_by_tenant(out) == {"attacker": 8, "witness": 1}
        for s in streams:
            if len(s.output_token_ids) > before[s.seq_id]:
                assert number - last_token_step[s.seq_id] <= 2
                last_token_step[s.seq_id] = number
    assert all(number - last <= 1 for last in last_token_step.values())


def test_a_tenant_waiting_without_a_free_slot_does_not_shrink_the_others_share():
    cache, sched = make(max_num_seqs=1, budget=64)
    submit(sched, "first", max_tokens=50, prompt_len=200)
    one_step(sched, cache)
    submit(sched, "second", max_tokens=4, prompt_len=6)  # no slot until the first finishes
    assert tokens_by_tenant(one_step(sched, cache)) == {"first": 64}


# --- shares counted by cost: a step's time grows with the context it attends over ----


def test_a_share_counts_a_sequences_context_not_only_its_tokens():
    cache, sched = make(max_num_seqs=64, budget=512)
    near, far = submit(sched, "a", prompt_len=6), submit(sched, "a", prompt_len=6)
    other = submit(sched, "b", prompt_len=6)
    near.num_computed_tokens, far.num_computed_tokens = 10, 8000
    shares = StepShares(512, {"a", "b"})
    # A decode at 8k context costs 1 + 8001 // 4096 + 8001 // 512 + 1 (its logits row)
    # = 18 tokens; at 11 tokens of context 2.
    assert step_cost(1, 8001, logit_rows=1) == 18 and step_cost(1, 11, logit_rows=1) == 2
    assert shares.fit(far, 1) == 1
    for _ in range(256 // 18):
        shares.spend(far, 1)
    assert shares.fit(far, 1) == 0  # 14 such decodes are the whole share of 256
    left = 256 - 14 * 18
    assert shares.fit(near, 64) == left - 1  # a short context fits by its tokens and row
    # A tenant's first token of the step always fits; a lone tenant counts tokens.
    other.num_computed_tokens = 50_000
    assert shares.fit(other, 1) == 1
    alone = StepShares(512, {"a"})
    assert alone.fit(far, 512) == 512


def test_long_context_decodes_of_one_tenant_do_not_fill_the_step_beside_another():
    cache, sched = make(max_num_seqs=64, num_blocks=2000, budget=64)
    # 24 streams over one cached 1,096-token history (the attacker's own), decoding.
    history = [next(_tokens) for _ in range(1096)]
    streams = [
        submit(sched, "attacker", max_tokens=1000, prompt_len=4, prefix=history) for _ in range(24)
    ]
    while any(not s.output_token_ids for s in streams):
        one_step(sched, cache)
    witness = submit(sched, "witness", max_tokens=12, prompt_len=6)
    decoded_at: dict[int, list[int]] = {s.seq_id: [] for s in streams}
    number = 0
    while witness.status is not SequenceStatus.FINISHED:
        out = one_step(sched, cache)
        number += 1
        attacker = [item for item in out.scheduled if tenant_of(item.seq) == "attacker"]
        # Each of those decodes reads 1,100 tokens of context or more: at least 4
        # tokens' cost with its logits row, so a share of 32 holds 8 of them (by tokens
        # alone, 31).
        cost = sum(step_cost(1, item.start + 1, logit_rows=1) for item in attacker)
        assert cost <= 32 and len(attacker) <= 8, (cost, len(attacker))
        assert tokens_by_tenant(out).get("witness", 0) >= 1
        for item in attacker:
            decoded_at[item.seq.seq_id].append(number)
    # Left-out decodes go first next time: every stream still moves every few steps.
    assert all(steps and steps[0] <= 3 for steps in decoded_at.values()), decoded_at


def test_a_share_counts_the_logits_rows_of_a_scored_prompt():
    cache, sched = make(max_num_seqs=64, budget=512)
    plain = submit(sched, "a", prompt_len=400)
    scored = submit(sched, "a", prompt_len=400, prompt_logprobs=20)
    submit(sched, "b", prompt_len=6)
    shares = StepShares(512, {"a", "b"})
    # A share of 256: a plain chunk of t tokens costs t + t * t // 4096 (its rows'
    # attention) + 1 (its last row's logits), so 241 fit; a scored one puts every row
    # through the LM head and the log-softmax, one more token each: 2t + t * t // 4096,
    # so 126 fit.
    assert step_cost(241, 241, logit_rows=1) == 256
    assert step_cost(126, 126, logit_rows=126) == 255
    assert shares.fit(plain, 400) == 241
    assert shares.fit(scored, 400) == 126


def test_a_tenant_scoring_long_prompts_gets_half_the_step_by_cost_beside_another():
    cache, sched = make(max_num_seqs=64, budget=64)
    for _ in range(4):
        submit(sched, "attacker", max_tokens=4, prompt_len=400, prompt_logprobs=5)
    witness = submit(sched, "witness", max_tokens=12, prompt_len=6)
    while witness.status is not SequenceStatus.FINISHED:
        out = one_step(sched, cache)
        attacker = [item for item in out.scheduled if tenant_of(item.seq) == "attacker"]
        # Its rows cost two tokens each: 16 of them are its half of the 64-token budget.
        assert sum(item.num_new_tokens for item in attacker) <= 16, out.scheduled
        assert tokens_by_tenant(out).get("witness", 0) >= 1
