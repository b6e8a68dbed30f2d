"""The public match queries: num_matched_tokens, match_prefix and pending blocks."""

import copy

import pytest

from cache import KVCacheManager, Namespace, PrefixMatch

BS = 4
TENANT_A = Namespace(b"salt-a", label="a")
TENANT_B = Namespace(b"salt-b", label="b")
PROMPT = list(range(100, 113))  # 3 full blocks + 1 token


def make(num_blocks=16, **kw):
    return KVCacheManager(num_blocks, block_size=BS, debug_checks=True, **kw)


def test_num_matched_tokens_is_the_hit_allocate_gets_and_changes_nothing():
    mgr = make(num_blocks=8)
    mgr.allocate("s1", PROMPT, TENANT_A)
    mgr.mark_computed("s1", len(PROMPT))
    mgr.free("s1")
    before = copy.deepcopy(mgr.stats_snapshot())
    ticks = mgr.tiers.index.tick
    assert mgr.num_matched_tokens(PROMPT, TENANT_A) == 12
    assert mgr.num_matched_tokens(PROMPT[:12], TENANT_A) == 8  # never the last token's block
    assert mgr.num_matched_tokens(PROMPT, TENANT_B) == 0
    assert mgr.stats_snapshot() == before
    assert mgr.tiers.index.tick == ticks
    assert mgr.allocate("s2", PROMPT, TENANT_A).num_cached_tokens == 12


def test_blocks_of_a_running_prefill_are_pending_until_computed():
    mgr = make()
    mgr.allocate("a", PROMPT, TENANT_A)
    probe = PROMPT + [7]
    assert mgr.match_prefix(probe, TENANT_A) == PrefixMatch(0, 12, 4)
    mgr.mark_computed("a", 6)  # chunked prefill: block 0 written
    match = mgr.match_prefix(probe, TENANT_A)
    assert (match.num_cached_tokens, match.num_pending_tokens) == (4, 8)
    mgr.mark_computed("a", len(PROMPT))
    match = mgr.match_prefix(probe, TENANT_A)
    assert (match.num_cached_tokens, match.num_pending_tokens) == (12, 0)
    assert mgr.stats_snapshot()["pending_blocks"] == 0


def test_pending_blocks_are_private_to_the_namespace_and_the_exact_tokens():
    mgr = make()
    mgr.allocate("a", PROMPT, TENANT_A)
    assert mgr.match_prefix(PROMPT + [7], TENANT_B).num_pending_tokens == 0
    other = PROMPT[:5] + [1] + PROMPT[6:]  # differs inside block 1
    assert mgr.match_prefix(other + [7], TENANT_A).num_pending_tokens == 4


def test_freeing_the_owner_drops_its_pending_blocks_but_not_another_owners():
    mgr = make()
    mgr.allocate("a", PROMPT, TENANT_A)
    mgr.allocate("b", PROMPT, TENANT_A)  # admitted in the same step: computes the same blocks
    mgr.free("a")
    assert mgr.match_prefix(PROMPT + [7], TENANT_A).num_pending_tokens == 12
    mgr.free("b")
    assert mgr.match_prefix(PROMPT + [7], TENANT_A).num_pending_tokens == 0
    assert mgr.stats_snapshot()["pending_blocks"] == 0


def test_a_second_computer_of_the_same_block_resolves_it_too():
    mgr = make()
    mgr.allocate("a", PROMPT, TENANT_A)
    mgr.allocate("b", PROMPT, TENANT_A)
    mgr.mark_computed("a", len(PROMPT))
    mgr.mark_computed("b", len(PROMPT))  # b keeps private copies and pins a's nodes
    mgr.free("a")
    assert mgr.match_prefix(PROMPT + [7], TENANT_A)[:2] == (12, 0)
    assert mgr.stats_snapshot()["pending_blocks"] == 0


def test_nothing_is_pending_without_the_prefix_cache():
    mgr = make(enable_prefix_cache=False)
    mgr.allocate("a", PROMPT, TENANT_A)
    assert mgr.match_prefix(PROMPT + [7], TENANT_A) == PrefixMatch(0, 0, 4)


@pytest.mark.parametrize(
    ("tokens", "namespace", "error"),
    [([], TENANT_A, ValueError), ([1, -2], TENANT_A, ValueError), ([1, 2], "a", TypeError)],
)
def test_bad_queries_raise_and_change_nothing(tokens, namespace, error):
    mgr = make()
    mgr.allocate("a", PROMPT, TENANT_A)
    before = copy.deepcopy(mgr.stats_snapshot())
    with pytest.raises(error):
        mgr.match_prefix(tokens, namespace)
    with pytest.raises(error):
        mgr.num_matched_tokens(tokens, namespace)
    assert mgr.stats_snapshot() == before


def test_integrity_check_catches_a_stale_pending_entry():
    mgr = make()
    mgr.allocate("a", PROMPT, TENANT_A)
    next(iter(mgr.pending.entries.values())).owners += 1
    with pytest.raises(AssertionError, match="pending block"):
        mgr.check_integrity()
