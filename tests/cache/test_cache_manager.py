"""KVCacheManager behaviour: matching, namespaces, collisions, CoW, eviction, tiers."""

import pytest

import cache.hashing
from cache import KVCacheManager, Namespace

BS = 4
TENANT_A = Namespace(b"salt-a", label="a")
TENANT_B = Namespace(b"salt-b", label="b")


def make(num_blocks=16, host=0, **kw):
    return KVCacheManager(num_blocks, block_size=BS, num_host_blocks=host, debug_checks=True, **kw)


def run_prompt(mgr, seq_id, tokens, ns=TENANT_A):
    """Allocate and 'compute' the whole prompt; returns the number of cached tokens."""
    result = mgr.allocate(seq_id, tokens, ns)
    mgr.mark_computed(seq_id, len(tokens))
    return result.num_cached_tokens


def test_prefix_hit_maps_the_same_blocks_but_never_the_last_token_block():
    mgr = make()
    prompt = list(range(12))  # exactly 3 blocks
    assert run_prompt(mgr, "s1", prompt) == 0
    table1 = mgr.block_table("s1")
    # Same prompt: the last block holds the last token, so only 2 blocks match.
    assert run_prompt(mgr, "s2", prompt) == 8
    assert mgr.block_table("s2")[:2] == table1[:2]
    assert mgr.block_table("s2")[2] != table1[2]
    assert run_prompt(mgr, "s3", prompt + [99]) == 12
    assert mgr.block_table("s3")[:3] == table1


def test_uncomputed_blocks_are_never_matched():
    mgr = make()
    prompt = list(range(16))
    mgr.allocate("s1", prompt, TENANT_A)
    mgr.mark_computed("s1", 6)  # chunked prefill: only block 0 is written
    assert mgr.allocate("s2", prompt, TENANT_A).num_cached_tokens == 4
    mgr.mark_computed("s1", 16)
    assert mgr.allocate("s3", prompt, TENANT_A).num_cached_tokens == 12


def test_generated_tokens_are_indexed_for_the_next_turn():
    mgr = make()
    run_prompt(mgr, "turn1", [1, 2, 3, 4, 5, 6])
    for token in [7, 8, 9]:
        mgr.append_slots("turn1", [token])
        mgr.mark_computed("turn1", mgr.num_tokens("turn1"))
    mgr.free("turn1")
    turn2 = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert mgr.allocate("turn2", turn2, TENANT_A).num_cached_tokens == 8


def test_tenants_never_share_private_blocks_but_share_the_shared_prompt():
    mgr = make(32)
    system = list(range(100, 110))  # 10 tokens: blocks 0-1 public, block 2 straddles
    a = Namespace(b"salt-a", shared_prefix_len=10, label="a")
    b = Namespace(b"salt-b", shared_prefix_len=10, label="b")
    prompt = system + [1, 2, 3, 4, 5, 6, 7, 8]
    run_prompt(mgr, "a1", prompt, a)
    hit = mgr.allocate("b1", prompt, b)
    assert hit.num_cached_tokens == 8  # the two public blocks only
    assert mgr.block_table("b1")[:2] == mgr.block_table("a1")[:2]
    assert mgr.block_table("b1")[2] != mgr.block_table("a1")[2]  # straddling block is private
    # Identical private text without a shared prompt: no hit across tenants.
    run_prompt(mgr, "a2", [5] * 12, TENANT_A)
    assert mgr.allocate("b2", [5] * 12, TENANT_B).num_cached_tokens == 0
    assert mgr.allocate("a3", [5] * 12, TENANT_A).num_cached_tokens == 8
    by_label = mgr.stats_snapshot()["by_label"]
    assert by_label["public"]["hit_blocks"] == 2
    assert by_label["a"]["hit_blocks"] == 2 and by_label["b"]["hit_blocks"] == 0


def test_forced_hash_collision_never_returns_foreign_kv(monkeypatch):
    monkeypatch.setattr(cache.hashing, "_digest", lambda data: b"\x07" * 16)
    mgr = make()
    run_prompt(mgr, "s1", [1, 2, 3, 4, 9])
    # Every block now hashes alike; the token check must reject the stored one.
    assert mgr.allocate("other-tokens", [5, 6, 7, 8, 9], TENANT_A).num_cached_tokens == 0
    assert mgr.allocate("other-tenant", [1, 2, 3, 4, 9], TENANT_B).num_cached_tokens == 0
    assert mgr.allocate("same", [1, 2, 3, 4, 9], TENANT_A).num_cached_tokens == 4
    # The colliding blocks are computed and left private instead of replacing the indexed one.
    mgr.mark_computed("other-tokens", 5)
    assert mgr.stats_snapshot()["indexed_blocks"] == 1
    mgr.check_integrity()


def test_identical_concurrent_prefill_keeps_the_indexed_block():
    mgr = make()
    prompt = list(range(9))
    mgr.allocate("s1", prompt, TENANT_A)
    mgr.allocate("s2", prompt, TENANT_A)  # nothing indexed yet: its own blocks
    mgr.mark_computed("s1", 9)
    mgr.mark_computed("s2", 9)
    assert mgr.stats_snapshot()["indexed_blocks"] == 2
    t1, t2 = mgr.block_table("s1"), mgr.block_table("s2")
    mgr.free("s1")
    mgr.free("s2")
    snap = mgr.stats_snapshot()["device"]
    assert snap["cached"] == 2 and snap["free"] == 16 - 2
    assert mgr.allocate("s3", prompt + [1], TENANT_A).num_cached_tokens == 8
    assert mgr.block_table("s3")[:2] == t1[:2] and t1[:2] != t2[:2]


def test_fork_shares_blocks_and_copies_on_first_write():
    mgr = make()
    run_prompt(mgr, "p", [1, 2, 3, 4, 5, 6])  # blocks: [full][2 of 4]
    mgr.fork("p", "c")
    assert mgr.block_table("c") == mgr.block_table("p")
    assert mgr.token_ids("c") == mgr.token_ids("p")
    shared = mgr.block_table("p")[1]
    result = mgr.append_slots("c", [7])
    fresh = mgr.block_table("c")[1]
    assert fresh != shared and result.plan.copies == ((shared, fresh),)
    assert result.slots == [fresh * BS + 2]
    # The parent now holds the block alone: no copy for its write.
    result = mgr.append_slots("p", [8])
    assert result.plan.is_empty and result.slots == [shared * BS + 2]
    assert mgr.block_table("c")[0] == mgr.block_table("p")[0]


def test_append_across_block_boundary_allocates_without_copy_even_if_shared():
    mgr = make()
    run_prompt(mgr, "p", [1, 2, 3, 4])
    mgr.fork("p", "c")
    result = mgr.append_slots("c", [5, 6, 7, 8, 9])
    assert result.plan.is_empty
    blocks = mgr.block_table("c")
    assert len(blocks) == 3 and blocks[0] == mgr.block_table("p")[0]
    assert result.slots == [blocks[1] * BS + i for i in range(4)] + [blocks[2] * BS]


def test_num_append_blocks_counts_fresh_blocks_and_copies_like_the_appends():
    mgr = make()
    run_prompt(mgr, "p", [1, 2, 3, 4, 5, 6])  # blocks: [full][2 of 4], both shared below
    for child in ("c1", "c2", "c3"):
        mgr.fork("p", child)
    beams = ["p", "c1", "c2", "c3"]
    # Four sharers of the partial block: three copy it, the last writes in place.
    assert mgr.num_append_blocks(beams) == 3
    # An outside sharer keeps it shared for every one of them.
    assert mgr.num_append_blocks(beams[:2]) == 2
    free = mgr.stats_snapshot()["device"]["free"]
    copies = [mgr.append_slots(seq, [7]).plan.copies for seq in beams]
    assert sum(len(c) for c in copies) == 3 and copies[-1] == ()
    assert free - mgr.stats_snapshot()["device"]["free"] == 3
    # Each partial block now has one holder: no copy, until the blocks fill up.
    assert mgr.num_append_blocks(beams) == 0
    for seq in beams:
        mgr.append_slots(seq, [8])
    assert mgr.num_append_blocks(beams) == 4  # every last block is full: a fresh one each
    with pytest.raises(ValueError, match="distinct"):
        mgr.num_append_blocks(["p", "p"])


def test_stop_indexing_frees_later_blocks_at_once_and_keeps_the_indexed_ones():
    mgr = make()
    run_prompt(mgr, "p", list(range(10)))  # two full blocks indexed, one partial
    mgr.stop_indexing("p")
    mgr.fork("p", "c")  # the fork inherits it
    for seq in ("p", "c"):
        mgr.append_slots(seq, [int(seq == "c"), 2, 3, 4])  # fills the third block, starts a fourth
        mgr.mark_computed(seq, 14)
    assert mgr.stats_snapshot()["indexed_blocks"] == 2
    mgr.free("c")
    mgr.free("p")
    snap = mgr.stats_snapshot()["device"]
    assert snap["used"] == 0 and snap["cached"] == 2 and snap["free"] == 16 - 2
    # The prompt's own blocks are still a hit.
    assert mgr.allocate("q", list(range(10)), TENANT_A).num_cached_tokens == 8


def test_eviction_takes_least_recently_used_leaf_first():
    mgr = make(6)
    run_prompt(mgr, "old", [1, 1, 1, 1, 2, 2, 2, 2, 0])  # old0 -> old1 indexed, 1 private
    run_prompt(mgr, "new", [3, 3, 3, 3, 0])  # new0 indexed, 1 private
    mgr.free("old")
    mgr.free("new")
    assert mgr.stats_snapshot()["device"] == {
        "total": 6,
        "free": 3,
        "used": 0,
        "cached": 3,
        "evictable": 3,
        "used_token_slots": 0,
    }
    # Needs 4: one eviction. Leaves are old1 and new0; old1 is older.
    mgr.allocate("big", list(range(50, 66)), TENANT_A)
    mgr.free("big")
    assert mgr.stats_snapshot()["evictions"]["dropped"] == 1
    assert mgr.allocate("o", [1, 1, 1, 1, 2, 2, 2, 2, 0], TENANT_A).num_cached_tokens == 4
    assert mgr.allocate("n", [3, 3, 3, 3, 0], TENANT_A).num_cached_tokens == 4


def test_lru_order_is_observable_through_hits():
    mgr = make(5)
    run_prompt(mgr, "x", [1, 1, 1, 1, 0])
    run_prompt(mgr, "y", [2, 2, 2, 2, 0])
    mgr.free("x")
    mgr.free("y")
    mgr.allocate("touch-x", [1, 1, 1, 1, 5], TENANT_A)  # x's block is now newer than y's
    mgr.free("touch-x")
    # 5 blocks: x0, y0 cached; 3 free. Needing 4 evicts exactly one: y0.
    mgr.allocate("z", list(range(50, 66)), TENANT_A)
    mgr.free("z")
    assert mgr.allocate("x2", [1, 1, 1, 1, 9], TENANT_A).num_cached_tokens == 4
    assert mgr.allocate("y2", [2, 2, 2, 2, 9], TENANT_A).num_cached_tokens == 0


def test_device_parent_is_kept_while_its_child_is_cached():
    mgr = make(4)
    run_prompt(mgr, "s", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    mgr.free("s")  # parent and child cached; the child is the only leaf
    mgr.allocate("t", [9, 9, 9, 9, 9, 9], TENANT_A)  # 2 free + 1 eviction
    assert mgr.allocate("u", [1, 1, 1, 1, 3], TENANT_A).num_cached_tokens == 4


def test_host_tier_swap_out_and_swap_in_plans():
    mgr = make(3, host=2)
    run_prompt(mgr, "s", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    dev0, dev1, _ = mgr.block_table("s")
    mgr.free("s")
    result = mgr.allocate("t", [9] * 12, TENANT_A)
    # Two evictions, leaf first: dev1 -> host 0, then dev0 -> host 1.
    assert result.plan.swap_out == ((dev1, 0), (dev0, 1))
    assert mgr.stats_snapshot()["host"]["used"] == 2
    mgr.free("t")
    result = mgr.allocate("u", [1, 1, 1, 1, 2, 2, 2, 2, 5], TENANT_A)
    assert result.num_cached_tokens == 8
    table = mgr.block_table("u")
    assert result.plan.swap_in == ((1, table[0]), (0, table[1]))
    snap = mgr.stats_snapshot()
    assert snap["swapped_in_blocks"] == 2 and snap["host"]["used"] == 0


def test_host_full_drops_least_recently_used_host_leaf():
    mgr = make(2, host=1)
    run_prompt(mgr, "a", [1, 1, 1, 1, 0])
    mgr.free("a")
    run_prompt(mgr, "b", [2, 2, 2, 2, 0])  # a0 cached; 1 free + needs 2 -> a0 to host
    mgr.free("b")
    mgr.allocate("c", [3, 3, 3, 3, 3], TENANT_A)  # evicts b0: host full -> drop a0
    snap = mgr.stats_snapshot()
    assert snap["evictions"] == {"to_host": 2, "dropped": 1}
    mgr.free("c")
    assert mgr.allocate("a2", [1, 1, 1, 1, 9], TENANT_A).num_cached_tokens == 0
    mgr.free("a2")
    result = mgr.allocate("b2", [2, 2, 2, 2, 9], TENANT_A)
    assert result.num_cached_tokens == 4 and len(result.plan.swap_in) == 1


def test_a_block_moved_to_a_full_host_and_dropped_in_the_same_plan_is_not_copied():
    mgr = make(3, host=1)
    run_prompt(mgr, "s", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    dev0, dev1, _ = mgr.block_table("s")
    mgr.free("s")
    # Two evictions in one plan with one host block: dev1 goes to the host, then dev0
    # needs it, and the host's LRU leaf is the block this plan just moved there.
    result = mgr.allocate("t", [9] * 12, TENANT_A)
    destinations = [host for _, host in result.plan.swap_out]
    assert len(destinations) == len(set(destinations))  # the copy kernel refuses repeats
    assert result.plan.swap_out == ((dev0, 0),)
    mgr.free("t")
    again = mgr.allocate("u", [1, 1, 1, 1, 5], TENANT_A)
    assert again.num_cached_tokens == 4 and again.plan.swap_in == ((0, mgr.block_table("u")[0]),)


def test_rehome_host_node_onto_identical_computed_block():
    mgr = make(2, host=1)
    run_prompt(mgr, "a", [1, 1, 1, 1, 0])
    mgr.free("a")
    mgr.allocate("b", [2, 2, 2, 2, 2], TENANT_A)  # evicts a0 to the host
    mgr.free("b")
    # Compute the same block again without matching it (cache lookup bypassed by a
    # different last block): prefill sees the host copy and adopts the new block.
    mgr.allocate("c", [1, 1, 1, 1], TENANT_A)
    mgr.mark_computed("c", 4)
    assert mgr.stats_snapshot()["host"]["used"] == 0
    mgr.free("c")
    result = mgr.allocate("d", [1, 1, 1, 1, 5], TENANT_A)
    assert result.num_cached_tokens == 4 and result.plan.is_empty


def test_num_blocks_needed_and_can_allocate_agree_with_allocate():
    mgr = make(4)
    run_prompt(mgr, "s", [1, 1, 1, 1, 2, 2, 2, 2, 0])
    mgr.free("s")
    prompt = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    # 4 blocks total, 2 matched but cached (each leaves the evictable pool), 2 new.
    assert mgr.num_blocks_needed(prompt, TENANT_A) == 4
    assert mgr.can_allocate(4) and not mgr.can_allocate(5)
    assert mgr.allocate("t", prompt, TENANT_A).num_cached_tokens == 8


def test_cache_off_never_matches():
    mgr = make(enable_prefix_cache=False)
    run_prompt(mgr, "s", list(range(9)))
    mgr.free("s")
    assert mgr.allocate("t", list(range(9)), TENANT_A).num_cached_tokens == 0
    snap = mgr.stats_snapshot()
    assert snap["indexed_blocks"] == 0 and snap["device"]["free"] == 16 - 3


def test_everything_is_released_after_all_sequences_finish():
    mgr = make(8, host=2)
    for i in range(6):
        run_prompt(mgr, i, [i % 3] * 4 + [i] * 3)
        mgr.fork(i, ("fork", i))
        mgr.append_slots(("fork", i), [1])
        mgr.free(i)
        mgr.free(("fork", i))
    snap = mgr.stats_snapshot()["device"]
    assert snap["used"] == 0 and snap["free"] + snap["cached"] == 8
    mgr.check_integrity()


def test_used_token_slots_count_shared_blocks_once():
    mgr = make()
    run_prompt(mgr, "p", [1, 2, 3, 4, 5, 6])  # [full][2 of 4]
    assert mgr.stats_snapshot()["device"]["used_token_slots"] == 6
    mgr.fork("p", "c")  # shares both blocks: still 6 slots in use
    assert mgr.stats_snapshot()["device"]["used_token_slots"] == 6
    mgr.append_slots("c", [7])  # CoW: the child's copy of block 1 holds 3 tokens
    assert mgr.stats_snapshot()["device"]["used_token_slots"] == 4 + 2 + 3
    mgr.free("p")
    mgr.free("c")
    assert mgr.stats_snapshot()["device"]["used_token_slots"] == 0
