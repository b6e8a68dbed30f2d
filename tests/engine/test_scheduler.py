"""Scheduler against a real KVCacheManager, no model: KV "computation" is update_from_step."""

import itertools

import pytest

from cache import KVCacheManager, Namespace
from chatsvc.engine.detokenizer import IncrementalDetokenizer
from chatsvc.engine.scheduler import Scheduler, SchedulerConfig
from chatsvc.engine.sequence import Sequence, SequenceStatus
from chatsvc.protocol import GenerationRequest, SamplingParams

BS = 4
NS = Namespace(tenant_salt=b"t", label="t")
_ids = itertools.count()


class _Tok:
    def decode(self, token_ids, skip_special_tokens=True):
        return " ".join(map(str, token_ids))


def make_seq(prompt, max_tokens=8, arrival=None):
    request = GenerationRequest(f"r{next(_ids)}", list(prompt), SamplingParams(max_tokens), NS)
    seq = Sequence(next(_ids), request, 0, list(prompt), IncrementalDetokenizer(_Tok(), []), None)
    if arrival is not None:
        seq.arrival_time = arrival
    return seq


def make(num_blocks=64, host=0, **config):
    cache = KVCacheManager(num_blocks, BS, num_host_blocks=host, debug_checks=True)
    return cache, Scheduler(cache, SchedulerConfig(**config))


def has_work(sched: Scheduler) -> bool:
    return bool(sched.waiting or sched.running)


def step(sched, cache, next_token=7):
    """Run one scheduled step the way the engine does, and finish sequences at max_tokens."""
    out = sched.schedule()
    assert all(len(item.slots) == item.num_new_tokens for item in out.scheduled)
    sched.update_from_step(out.scheduled)
    for item in out.scheduled:
        seq = item.seq
        assert seq.num_computed_tokens == cache.num_computed_tokens(seq.seq_id)
        if item.completes:
            seq.append_token(next_token, 0.0)
            if len(seq.output_token_ids) >= seq.sampling.max_tokens:
                seq.status = SequenceStatus.FINISHED
                sched.remove(seq)
    cache.check_integrity()
    return out


def test_chunked_prefill_samples_only_after_the_last_chunk():
    cache, sched = make(max_num_batched_tokens=16)
    seq = make_seq(range(100, 140))
    sched.add(seq)
    chunks = []
    for _ in range(3):
        out = step(sched, cache)
        chunks.append([(s.num_new_tokens, s.completes) for s in out.scheduled])
    assert chunks == [[(16, False)], [(16, False)], [(8, True)]]
    assert seq.output_token_ids == [7]
    assert [(s.num_new_tokens, s.completes) for s in step(sched, cache).scheduled] == [(1, True)]


def test_decodes_go_first_and_prefill_gets_the_rest_of_the_budget():
    cache, sched = make(max_num_batched_tokens=10)
    a, b = make_seq(range(10, 13)), make_seq(range(20, 23))
    sched.add(a)
    sched.add(b)
    step(sched, cache)  # both prefilled (3 + 3 tokens)
    long = make_seq(range(1000, 1030))
    sched.add(long)
    out = step(sched, cache)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1), (long, 8)]
    out = step(sched, cache)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1), (long, 8)]


def test_slots_follow_the_block_table():
    cache, sched = make()
    seq = make_seq(range(50, 59))
    sched.add(seq)
    out = step(sched, cache)
    table = cache.block_table(seq.seq_id)
    expected = [table[p // BS] * BS + p % BS for p in range(9)]
    assert out.scheduled[0].slots == expected
    out = step(sched, cache)  # decode: token 9 goes to offset 1 of block 2
    assert out.scheduled[0].slots == [table[2] * BS + 1]


def test_admission_matches_the_prefix_and_computes_only_the_suffix():
    cache, sched = make()
    first = make_seq(range(300, 314), max_tokens=1)
    sched.add(first)
    step(sched, cache)
    assert first.status is SequenceStatus.FINISHED
    follow_up = make_seq([*range(300, 314), 7, 1, 2, 3])
    sched.add(follow_up)
    out = step(sched, cache)
    # 15 tokens (prompt 14 + answer 7) were computed; 12 of them lie in full blocks.
    assert follow_up.num_cached_tokens == 12
    assert out.scheduled[0].num_new_tokens == len(follow_up.prompt_token_ids) - 12


def test_longest_cached_prefix_first_with_an_age_bound():
    cache, sched = make(max_num_seqs=1, max_wait_steps=3)
    warm = make_seq(range(400, 420), max_tokens=1)
    sched.add(warm)
    step(sched, cache)
    cold = make_seq(range(900, 920), max_tokens=2)
    hot = make_seq([*range(400, 420), 5, 6], max_tokens=2)
    sched.add(cold)
    sched.add(hot)
    step(sched, cache)
    assert hot.status is SequenceStatus.RUNNING and cold.status is SequenceStatus.WAITING
    # A stream of newcomers with a better prefix goes ahead of `cold`, but only until
    # `cold` has waited past the bound.
    admitted = [hot]
    for i in range(12):
        sched.add(make_seq([*range(400, 420), 100 + i], max_tokens=2))
        step(sched, cache)
        admitted.extend(seq for seq in sched.running if seq not in admitted)
    assert hot in admitted and cold in admitted
    position = admitted.index(cold)
    assert 2 <= position <= 4, [seq.request.request_id for seq in admitted]


def test_out_of_blocks_preempts_the_newest_and_everything_finishes():
    # 8 blocks of 4: two sequences of 8 prompt + 12 output tokens need 10 blocks together.
    cache, sched = make(num_blocks=8)
    old, new = make_seq(range(10, 18), max_tokens=12), make_seq(range(30, 38), max_tokens=12)
    sched.add(old)
    sched.add(new)
    preempted = []
    for _ in range(100):
        if not has_work(sched):
            break
        preempted.extend(step(sched, cache).preempted)
    assert not has_work(sched)
    assert preempted and preempted[0] is new
    assert len(old.output_token_ids) == len(new.output_token_ids) == 12
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    snapshot = cache.stats_snapshot()["device"]
    assert snapshot["used"] == 0
    assert snapshot["free"] + snapshot["evictable"] == 8


def test_preempted_sequence_reuses_its_indexed_blocks_from_the_host_tier():
    cache, sched = make(num_blocks=8, host=16)
    old, new = make_seq(range(10, 18), max_tokens=12), make_seq(range(30, 38), max_tokens=12)
    sched.add(old)
    sched.add(new)
    plans = []
    while has_work(sched):
        plans.extend(step(sched, cache).plans)
    assert any(p.swap_out for p in plans)
    assert len(new.output_token_ids) == 12
    assert cache.stats_snapshot()["device"]["used"] == 0


def test_request_that_never_fits_fails_instead_of_stalling():
    cache, sched = make(num_blocks=2)
    seq = make_seq(range(0, 20))
    sched.add(seq)
    out = sched.schedule()
    assert [s for s, _ in out.failed] == [seq]
    assert isinstance(out.failed[0][1], ValueError)
    assert not has_work(sched)


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0).validate()
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0).validate()


SHARED = list(range(500, 512))  # 3 full blocks of a "system prompt"


def test_a_prefix_being_computed_defers_its_twins_for_a_full_hit():
    cache, sched = make()
    seqs = [make_seq([*SHARED, 600 + i, 601 + i], max_tokens=2) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    out = step(sched, cache)
    assert [s.seq for s in out.scheduled] == seqs[:1]
    assert sched.num_deferrals == 3
    out = step(sched, cache)
    assert {s.seq for s in out.scheduled} == set(seqs)
    assert [seq.num_cached_tokens for seq in seqs] == [0, 12, 12, 12]
    assert [s.num_new_tokens for s in out.scheduled[1:]] == [2, 2, 2]


def test_without_deferral_twins_compute_the_prefix_again():
    cache, sched = make(max_defer_steps=0)
    seqs = [make_seq([*SHARED, 600 + i, 601 + i], max_tokens=2) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    out = step(sched, cache)
    assert [s.seq for s in out.scheduled] == seqs
    assert [seq.num_cached_tokens for seq in seqs] == [0, 0, 0, 0]


def test_deferral_is_bounded_when_the_prefill_does_not_advance():
    # A prefill that stalls (here: allocated outside the scheduler and never computed)
    # holds its twin back for max_defer_steps steps only.
    cache, sched = make(max_defer_steps=3)
    cache.allocate("stalled", [*SHARED, 1], NS)
    twin = make_seq([*SHARED, 2], max_tokens=1)
    sched.add(twin)
    for _ in range(3):
        assert step(sched, cache).scheduled == []
    out = step(sched, cache)
    assert [s.seq for s in out.scheduled] == [twin]
    assert twin.num_deferred_steps == 3 and twin.num_cached_tokens == 0
    cache.free("stalled")


def test_a_chunked_prefill_defers_its_twin_until_the_prefix_is_written():
    cache, sched = make(max_num_batched_tokens=16)
    long_prefix = list(range(700, 760))
    first = make_seq([*long_prefix, 1], max_tokens=1)
    twin = make_seq([*long_prefix, 2], max_tokens=1)
    sched.add(first)
    sched.add(twin)
    while twin.status is SequenceStatus.WAITING:
        step(sched, cache)
    assert twin.num_deferred_steps >= 1
    assert twin.num_cached_tokens == len(long_prefix)


def test_aged_requests_are_never_deferred():
    cache, sched = make(max_wait_s=5.0)
    first = make_seq([*SHARED, 1], max_tokens=1)
    old = make_seq([*SHARED, 2], max_tokens=1, arrival=-1e9)  # waited "forever"
    sched.add(first)
    sched.add(old)
    out = step(sched, cache)
    # The aged one goes first and is admitted; the fresh twin then waits for its prefix.
    assert [s.seq for s in out.scheduled] == [old]
    assert old.num_deferred_steps == 0 and first.num_deferred_steps == 1
    step(sched, cache)
    assert first.num_cached_tokens == len(SHARED)


def test_defer_config_validation():
    with pytest.raises(ValueError, match="max_defer_steps"):
        SchedulerConfig(max_defer_steps=-1).validate()


def test_a_waiting_prompt_is_hashed_once_from_ranking_to_indexing(monkeypatch):
    import cache.hashing

    hashed = []
    real = cache.hashing._digest
    monkeypatch.setattr(cache.hashing, "_digest", lambda data: hashed.append(data) or real(data))
    cache_, sched = make(max_num_batched_tokens=8)
    first, second = make_seq(range(100, 122), max_tokens=1), make_seq(range(200, 222))
    sched.add(first)
    sched.add(second)  # ranked and deferred behind the first for some steps
    while sched.waiting or sched.running:
        step(sched, cache_)
    # Each block once: the first's 22 prompt tokens fill 5; the second has KV for 29
    # tokens (its prompt and 7 of its 8 outputs), 7 blocks.
    assert len(hashed) == len(set(hashed)) == 5 + 7
    assert second.output_token_ids == [7] * 8


def test_twins_of_a_prompt_loading_from_disk_wait_for_it_instead_of_loading_it_again():
    from cache.disk_index import DiskIndex

    clock = itertools.count(1000).__next__
    disk = DiskIndex(100, 100_000)
    prefix = list(range(800, 824))  # 6 blocks, on disk from an earlier process
    before, _ = make()
    before.attach_disk(disk, clock)
    before.allocate("earlier", [*prefix, 1], NS)
    before.mark_computed("earlier", len(prefix) + 1)
    for store in before.take_stores():
        assert disk.reserve(store.hash, store.parent_hash, store.owner, store.shared).granted
        assert disk.finish_write(store.hash, clock(), ok=True)

    cache, sched = make(max_defer_steps=2, max_wait_steps=3)
    cache.attach_disk(disk, clock)
    first, twin = make_seq([*prefix, 2], max_tokens=1), make_seq([*prefix, 3], max_tokens=1)
    sched.add(first)
    sched.add(twin)
    out = sched.schedule()
    assert [(seq, len(loads)) for seq, loads in out.loads] == [(first, 6)]
    # The loop wakes once per block read while nothing computes: far more steps than
    # the deferral and aging bounds, and the twin still waits rather than load again.
    for _ in range(10):
        out = sched.schedule()
        assert not out.scheduled and not out.loads
    assert twin.status is SequenceStatus.WAITING and twin.num_deferred_steps == 1
    sched.finish_loading(first, 6)
    out = step(sched, cache)
    assert {item.seq for item in out.scheduled} == {first, twin} and not out.loads
    assert twin.num_cached_tokens == len(prefix) and first.num_cached_tokens == len(prefix)
    assert cache.stats_snapshot()["hit_tokens_by_tier"] == {
        "device": len(prefix),
        "host": 0,
        "disk": len(prefix),
    }


def _disk_with(prompts):
    """A disk index holding every full block of ``prompts``, as an earlier process left it."""
    from cache.disk_index import DiskIndex

    clock = itertools.count(1000).__next__
    disk = DiskIndex(100, 100_000)
    before, _ = make()
    before.attach_disk(disk, clock)
    for i, prompt in enumerate(prompts):
        before.allocate(f"earlier{i}", [*prompt, 1], NS)
        before.mark_computed(f"earlier{i}", len(prompt) + 1)
    for store in before.take_stores():
        assert disk.reserve(store.hash, store.parent_hash, store.owner, store.shared).granted
        assert disk.finish_write(store.hash, clock(), ok=True)
    return disk, clock


# Sessions returning after a restart: one system prompt (2 blocks) and each one's own
# history (4 blocks), all on disk.
SYSTEM_PROMPT = list(range(900, 908))
HISTORIES = [[*SYSTEM_PROMPT, *range(1000 + 100 * i, 1016 + 100 * i)] for i in range(3)]


def _returning(now=lambda: 0.0, **config):
    disk, clock = _disk_with(HISTORIES)
    cache = KVCacheManager(64, BS, debug_checks=True)
    sched = Scheduler(cache, SchedulerConfig(**config), clock=now)
    cache.attach_disk(disk, clock)
    seqs = [make_seq([*history, 5], max_tokens=2) for history in HISTORIES]
    for seq in seqs:
        sched.add(seq)
    return cache, sched, seqs


def test_twins_load_their_own_blocks_while_the_first_waits_then_all_prefill_together():
    cache, sched, seqs = _returning(max_load_gather_s=60.0)
    out = sched.schedule()
    assert [(seq, len(loads)) for seq, loads in out.loads] == [(seqs[0], 6)]
    assert sched.num_deferrals == 2  # the twins wait for the system prompt's blocks
    sched.finish_loading(seqs[0], 6)
    # The first one's prefill would make a step of its own: it waits while the twins
    # (the system prompt now on the device) load their own histories.
    out = sched.schedule()
    assert not out.scheduled
    assert [(seq, len(loads)) for seq, loads in out.loads] == [(seqs[1], 4), (seqs[2], 4)]
    sched.finish_loading(seqs[1], 4)
    for _ in range(3):  # the loop wakes per landed load: every wakeup waits
        out = sched.schedule()
        assert not out.scheduled and not out.loads
    sched.finish_loading(seqs[2], 4)
    out = step(sched, cache)
    assert {item.seq for item in out.scheduled} == set(seqs)
    assert [item.num_new_tokens for item in out.scheduled] == [1, 1, 1]
    assert [seq.cached_by_tier["disk"] for seq in seqs] == [24, 16, 16]
    assert [seq.cached_by_tier["device"] for seq in seqs] == [0, 8, 8]


def test_the_wait_for_loads_is_bounded_and_never_holds_back_running_work():
    cache, sched, seqs = _returning(max_load_gather_s=0.0)
    sched.schedule()
    sched.finish_loading(seqs[0], 6)
    out = step(sched, cache)  # no wait: it computes beside the twins' loads
    assert [item.seq for item in out.scheduled] == seqs[:1]
    assert [seq for seq, _ in out.loads] == seqs[1:]

    now = [100.0]
    cache, sched, seqs = _returning(lambda: now[0], max_load_gather_s=0.1)
    sched.schedule()
    sched.finish_loading(seqs[0], 6)
    assert not sched.schedule().scheduled  # the twins start loading, the first one waits
    now[0] += 0.05
    assert not step(sched, cache).scheduled
    now[0] += 0.05  # the bound: it prefills and samples its first token, a decode now
    assert [item.seq for item in step(sched, cache).scheduled] == seqs[:1]
    sched.finish_loading(seqs[1], 4)  # lands while it decodes: nothing waits
    out = step(sched, cache)
    assert {item.seq for item in out.scheduled} == set(seqs[:2])


def test_load_gather_config_validation():
    with pytest.raises(ValueError, match="max_load_gather_s"):
        SchedulerConfig(max_load_gather_s=-1.0).validate()
