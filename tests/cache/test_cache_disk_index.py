"""The disk tier's bookkeeping (cache.disk_index) and its hooks in the manager, without torch.

The files are not here: "writing" a block is reserve + finish_write, as the
engine's I/O thread reports it.
"""

import pytest

from cache import KVCacheManager, Namespace
from cache.disk_index import DiskIndex
from cache.errors import CacheIntegrityError
from cache.forget import owner_digest
from cache.hashing import ROOT_HASH, BlockHasher
from cache.namespace import PUBLIC_KEY

BS = 4
TENANT = Namespace(b"salt-a", label="a")
NBYTES = 100


class Clock:
    """Wall-clock stand-in: the disk tier's recency is seconds, and tests step it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make(num_blocks=16, host=0, budget_blocks=1000, write_through=True):
    mgr = KVCacheManager(num_blocks, block_size=BS, num_host_blocks=host, debug_checks=True)
    disk = DiskIndex(NBYTES, budget_blocks * NBYTES)
    mgr.attach_disk(disk, Clock(), write_through=write_through)
    return mgr, disk


def persist(mgr, disk, stores):
    """What the engine does with a list of BlockStores: reserve, write, report."""
    for store in stores:
        reservation = disk.reserve(
            store.hash, store.parent_hash, store.owner, store.shared, store.owners
        )
        if reservation.granted:
            assert disk.finish_write(store.hash, mgr._clock(), ok=True)


def run_prompt(mgr, seq_id, tokens, ns=TENANT, owner=b""):
    result = mgr.allocate(seq_id, tokens, ns, owner=owner)
    assert not result.loads
    mgr.mark_computed(seq_id, len(tokens))
    return result


def chain_hashes(tokens, ns=TENANT):
    hasher, parent, out = BlockHasher(BS), ROOT_HASH, []
    for i in range(len(tokens) // BS):
        parent = hasher.hash_block(parent, tuple(tokens[i * BS : (i + 1) * BS]), ns.key(i, BS))
        out.append(parent)
    return out


# -- DiskIndex ------------------------------------------------------------------------


def test_budget_evicts_least_recently_used_leaf_first():
    disk = DiskIndex(NBYTES, 3 * NBYTES)
    for i, (hash_, parent) in enumerate([(h(1), ROOT_HASH), (h(2), h(1)), (h(3), ROOT_HASH)]):
        assert disk.reserve(hash_, parent, b"", False).granted
        disk.finish_write(hash_, 10.0 + i, ok=True)
    disk.touch([h(3)], 50.0)
    # h(1) is older than h(3) but has a child on disk: the leaf h(2) goes first.
    reservation = disk.reserve(h(4), ROOT_HASH, b"", False)
    assert reservation.granted and [e.hash for e in reservation.evicted] == [h(2)]
    disk.finish_write(h(4), 60.0, ok=True)
    assert [e.hash for e in disk.reserve(h(5), ROOT_HASH, b"", False).evicted] == [h(1)]
    assert h(3) in disk and h(4) in disk and disk.used_bytes == 3 * NBYTES
    disk.check()


def test_shared_prompt_blocks_are_evicted_last_and_never_for_a_session_block():
    disk = DiskIndex(NBYTES, 2 * NBYTES)
    assert disk.reserve(h(1), ROOT_HASH, b"", True).granted
    disk.finish_write(h(1), 1.0, ok=True)
    assert disk.reserve(h(2), ROOT_HASH, b"", False).granted
    disk.finish_write(h(2), 2.0, ok=True)
    # The session block is newer, yet it goes before the older shared one.
    assert [e.hash for e in disk.reserve(h(3), ROOT_HASH, b"", False).evicted] == [h(2)]
    disk.finish_write(h(3), 3.0, ok=True)
    # Only shared blocks (and the session block h3) remain: h3 goes, then a session
    # block cannot push out a shared one.
    disk.reserve(h(4), ROOT_HASH, b"", True)
    disk.finish_write(h(4), 4.0, ok=True)
    refused = disk.reserve(h(5), ROOT_HASH, b"", False)
    assert not refused.granted and disk.num_refused == 1
    assert h(1) in disk and h(4) in disk
    disk.check()


def test_a_write_is_indexed_only_when_complete_and_a_forgotten_one_never():
    disk = DiskIndex(NBYTES, 10 * NBYTES)
    assert disk.reserve(h(1), ROOT_HASH, b"o", False).granted
    assert h(1) not in disk and disk.is_stored_or_writing(h(1))
    assert not disk.continues(h(1), ROOT_HASH)  # a queued block is never matched
    assert not disk.reserve(h(1), ROOT_HASH, b"o", False).granted  # no second write
    assert disk.remove(h(1)).doomed
    assert not disk.finish_write(h(1), 1.0, ok=True)
    assert h(1) not in disk and disk.used_bytes == 0
    assert disk.reserve(h(2), ROOT_HASH, b"", False).granted
    assert not disk.finish_write(h(2), 1.0, ok=False)  # a failed write frees its room
    assert disk.used_bytes == 0
    disk.check()


def test_lowering_the_budget_evicts_until_it_fits():
    disk = DiskIndex(NBYTES, 10 * NBYTES)
    for i in range(6):
        disk.reserve(h(i), ROOT_HASH, b"", i % 2 == 0)
        disk.finish_write(h(i), float(i), ok=True)
    evicted = disk.set_budget(3 * NBYTES)
    assert [e.hash for e in evicted] == [h(1), h(3), h(5)]  # session blocks first
    assert disk.used_bytes == 3 * NBYTES
    disk.check()


def test_check_notices_a_broken_children_map():
    disk = DiskIndex(NBYTES, 10 * NBYTES)
    disk.reserve(h(1), ROOT_HASH, b"", False)
    disk.finish_write(h(1), 1.0, ok=True)
    disk.children[ROOT_HASH].discard(h(1))
    with pytest.raises(CacheIntegrityError):
        disk.check()


# -- the manager over a disk tier ------------------------------------------------------


def test_write_through_stores_each_computed_block_once():
    mgr, disk = make()
    run_prompt(mgr, "s1", list(range(13)))
    stores = mgr.take_stores()
    assert [s.hash for s in stores] == chain_hashes(list(range(13)))  # 3 full blocks
    assert all(s.location == "device" for s in stores)
    persist(mgr, disk, stores)
    mgr.free("s1")
    longer = list(range(13)) + [50, 51, 52]
    run_prompt(mgr, "s2", longer)
    # The three hit blocks are on disk already: only the new fourth one is stored.
    assert [s.hash for s in mgr.take_stores()] == chain_hashes(longer)[3:]
    mgr.check_integrity()


def test_write_back_stores_a_block_only_when_memory_drops_it():
    mgr, disk = make(num_blocks=4, write_through=False)
    run_prompt(mgr, "s1", list(range(12)))  # 3 blocks, all full and indexed
    assert mgr.take_stores() == []
    mgr.free("s1")
    result = mgr.allocate("s2", list(range(100, 112)), TENANT)  # needs 3 of 4 blocks
    dropped = [s.hash for s in result.plan.stores]
    assert dropped == chain_hashes(list(range(12)))[::-1][:2]  # LRU leaves, deepest first
    persist(mgr, disk, result.plan.stores)
    assert all(hash_ in disk for hash_ in dropped)
    mgr.check_integrity()


def test_host_tier_drops_go_to_disk_too():
    mgr, disk = make(num_blocks=3, host=1, write_through=False)
    run_prompt(mgr, "s1", list(range(12)))
    mgr.free("s1")
    plan = mgr.allocate("s2", list(range(100, 108)), TENANT).plan
    # Two evictions into a one-block host tier: device 2 -> host 0, then host 0's node
    # is dropped to make room for device 1 -> host 0, so its own swap-out goes (never
    # two copies into one block). The dropped node is stored, and since stores run
    # before the swaps, from device 2, where its data still is then.
    assert plan.swap_out == ((1, 0),)
    hashes = chain_hashes(list(range(12)))
    assert [(s.location, s.block_id, s.hash) for s in plan.stores] == [("device", 2, hashes[2])]
    persist(mgr, disk, plan.stores)
    mgr.free("s2")
    # A host-resident node dropped by a later plan is stored from its host block.
    plan = mgr.allocate("s3", list(range(200, 212)), TENANT).plan
    assert ("host", 0, hashes[1]) in [(s.location, s.block_id, s.hash) for s in plan.stores]
    mgr.check_integrity()


def test_match_continues_from_memory_into_disk_and_loads_into_fresh_blocks():
    mgr, disk = make(num_blocks=8)
    history = list(range(20))  # 5 blocks
    run_prompt(mgr, "t1", history)
    persist(mgr, disk, mgr.take_stores())
    mgr.free("t1")
    # A new manager with the same disk stands for a restart: memory is empty.
    fresh = KVCacheManager(8, block_size=BS, debug_checks=True)
    fresh.attach_disk(disk, Clock())
    prompt = history + [90, 91, 92]
    match = fresh.match_prefix(prompt, TENANT)
    assert (match.num_cached_tokens, match.num_disk_tokens) == (0, 20)
    result = fresh.allocate("t2", prompt, TENANT)
    assert result.num_cached_tokens == 0 and len(result.loads) == 5
    table = fresh.block_table("t2")
    assert [load.device_block for load in result.loads] == table[:5]
    assert [load.hash for load in result.loads] == chain_hashes(history)
    assert result.loads[0].token_ids == (0, 1, 2, 3)
    # Another request for the same prefix sees the loading blocks as pending.
    assert fresh.match_prefix(prompt + [7], TENANT).num_pending_tokens == 20
    fresh.complete_load("t2", 5)
    assert fresh.num_computed_tokens("t2") == 20
    snapshot = fresh.stats_snapshot()
    assert snapshot["hit_tokens_by_tier"] == {"device": 0, "host": 0, "disk": 20}
    assert snapshot["hit_tokens"] == 20
    fresh.free("t2")
    # The loaded blocks are ordinary device hits now.
    assert fresh.allocate("t3", prompt, TENANT).num_cached_tokens == 20
    fresh.check_integrity()


def test_a_failed_load_counts_only_the_verified_prefix():
    mgr, disk = make(num_blocks=8)
    run_prompt(mgr, "t1", list(range(16)))
    persist(mgr, disk, mgr.take_stores())
    fresh = KVCacheManager(8, block_size=BS, debug_checks=True)
    fresh.attach_disk(disk, Clock())
    result = fresh.allocate("t2", list(range(17)), TENANT)
    assert len(result.loads) == 4
    with pytest.raises(ValueError):
        fresh.complete_load("t2", 5)
    fresh.complete_load("t2", 2)
    assert fresh.num_computed_tokens("t2") == 8
    with pytest.raises(ValueError):
        fresh.complete_load("t2", 1)  # loads are completed once
    fresh.check_integrity()


def test_disk_blocks_of_another_tenant_never_match():
    mgr, disk = make()
    run_prompt(mgr, "a", list(range(12)))
    persist(mgr, disk, mgr.take_stores())
    fresh = KVCacheManager(8, block_size=BS, debug_checks=True)
    fresh.attach_disk(disk, Clock())
    other = Namespace(b"salt-b", label="b")
    assert fresh.match_prefix(list(range(13)), other).num_disk_tokens == 0
    assert fresh.match_prefix(list(range(13)), TENANT).num_disk_tokens == 12


def test_device_eviction_keeps_shared_prompt_blocks_longest():
    mgr = KVCacheManager(4, block_size=BS, debug_checks=True)
    shared = Namespace(b"salt-a", shared_prefix_len=4, label="a")
    run_prompt(mgr, "old", [1, 2, 3, 4], shared)  # one public block, used first
    mgr.free("old")
    run_prompt(mgr, "new", [9, 9, 9, 9, 8, 8, 8, 8], TENANT)  # two newer private blocks
    mgr.free("new")
    mgr.allocate("x", [5, 5, 5, 5, 6, 6, 6, 6], TENANT)  # needs 2: private ones go first
    assert mgr.num_matched_tokens([1, 2, 3, 4, 0], shared) == 4
    mgr.check_integrity()


# -- forgetting a session ---------------------------------------------------------------


def test_forget_removes_a_session_from_every_tier_but_keeps_what_others_use():
    mgr, disk = make(num_blocks=32)
    system = [7] * 8  # two blocks of a private system prompt both sessions start with
    a_owner, b_owner = owner_digest(b"salt-a", "A"), owner_digest(b"salt-a", "B")
    a_tokens = system + list(range(100, 112))
    b_tokens = system + list(range(200, 208))
    run_prompt(mgr, "a", a_tokens, owner=a_owner)
    run_prompt(mgr, "b", b_tokens, owner=b_owner)
    # An unacknowledged turn of A: its blocks hang below A's stored history.
    run_prompt(mgr, "a2", a_tokens + [1, 2, 3, 4, 5], owner=a_owner)
    persist(mgr, disk, mgr.take_stores())
    for seq in ("a", "b", "a2"):
        mgr.free(seq)
    before = len(disk)
    result = mgr.forget(a_tokens, TENANT, a_owner)
    # A's three history blocks and the extra turn's block go; the system prompt stays.
    assert (result.device_blocks, len(result.disk_blocks)) == (4, 4)
    assert len(disk) == before - 4
    assert mgr.match_prefix(b_tokens + [0], TENANT).num_cached_tokens == len(b_tokens)
    assert mgr.match_prefix(a_tokens + [0], TENANT).num_cached_tokens == len(system)
    mgr.check_integrity()


def test_forget_keeps_blocks_a_running_sequence_holds_and_shared_prompts():
    mgr, disk = make(num_blocks=32)
    shared = Namespace(b"salt-a", shared_prefix_len=8, label="a")
    tokens = list(range(16))
    run_prompt(mgr, "a", tokens, shared)
    persist(mgr, disk, mgr.take_stores())
    result = mgr.forget(tokens, shared)  # "a" still runs: nothing can go yet
    assert result.device_blocks == 0 and not result.disk_blocks
    mgr.free("a")
    result = mgr.forget(tokens, shared)
    assert result.device_blocks == 2 and len(result.disk_blocks) == 2  # public blocks stay
    assert mgr.match_prefix(tokens, shared).num_cached_tokens == 8
    mgr.check_integrity()


def test_forget_reaches_blocks_only_on_disk_after_a_restart():
    mgr, disk = make(num_blocks=32)
    owner = owner_digest(b"salt-a", "A")
    run_prompt(mgr, "a", list(range(12)), owner=owner)
    run_prompt(mgr, "a2", list(range(16)), owner=owner)  # a turn never stored
    persist(mgr, disk, mgr.take_stores())
    fresh = KVCacheManager(8, block_size=BS, debug_checks=True)
    fresh.attach_disk(disk, Clock())
    result = fresh.forget(list(range(12)), TENANT, owner)
    assert len(result.disk_blocks) == 4 and len(disk) == 0
    fresh.check_integrity()


def test_public_key_marks_shared_blocks_in_stores():
    mgr, disk = make()
    shared = Namespace(b"salt-a", shared_prefix_len=4, label="a")
    run_prompt(mgr, "a", list(range(9)), shared)
    stores = mgr.take_stores()
    assert [s.shared for s in stores] == [True, False]
    assert PUBLIC_KEY == shared.key(0, BS)


# -- session-aware recency ------------------------------------------------------------------


def test_eviction_follows_the_last_activity_of_the_sessions_using_a_block():
    mgr = KVCacheManager(6, block_size=BS, debug_checks=True)
    old = list(range(8))  # session A: two blocks, computed first
    run_prompt(mgr, "a1", old)
    mgr.free("a1")
    run_prompt(mgr, "b1", list(range(50, 58)))  # session B: computed later, then idle
    mgr.free("b1")
    run_prompt(mgr, "a2", old + [9, 9, 9, 9, 1])  # A is active again: its chain is touched
    mgr.free("a2")
    mgr.allocate("x", list(range(90, 102)), TENANT)  # one block is free: two must go
    # B's blocks are older than A's first block by creation, but A was used since.
    assert mgr.num_matched_tokens(old + [9, 9, 9, 9, 1], TENANT) == 12
    assert mgr.num_matched_tokens(list(range(50, 59)), TENANT) == 0
    mgr.check_integrity()


def test_memory_hits_refresh_the_disk_copies_so_an_active_session_stays_on_disk():
    mgr, disk = make(num_blocks=32, budget_blocks=4)
    a, b = list(range(8)), list(range(50, 58))
    run_prompt(mgr, "a1", a)
    persist(mgr, disk, mgr.take_stores())  # A's two blocks, written first
    run_prompt(mgr, "b1", b)
    persist(mgr, disk, mgr.take_stores())  # B's two blocks
    mgr.free("a1")
    mgr.free("b1")
    run_prompt(mgr, "a2", a + [1])  # a hit in memory: A's disk copies become recent too
    evicted = disk.reserve(h(77), ROOT_HASH, b"", False).evicted
    assert [e.hash for e in evicted] == chain_hashes(b)[1:]  # B's leaf, not A's
    disk.check()


def test_recent_chains_are_whole_from_the_root_most_recent_first_and_bounded():
    disk = DiskIndex(NBYTES, 1000 * NBYTES)
    # Two sessions under one shared block (1): 1 <- 2 <- 3 (used at 30) and 1 <- 4 <- 5
    # (used at 50); 7 hangs below a block that is not on disk (6), so no match reaches it.
    for hash_, parent, used in [(1, 0, 10), (2, 1, 20), (3, 2, 30), (4, 1, 40), (5, 4, 50)]:
        disk.add(h(hash_), ROOT_HASH if parent == 0 else h(parent), b"", hash_ == 1, used)
    disk.add(h(7), h(6), b"", False, 99)

    assert [e.hash for e in disk.recent_chains(10)] == [h(1), h(4), h(5), h(2), h(3)]
    # Bounded: a chain that does not fit whole gives its blocks nearest the root.
    assert [e.hash for e in disk.recent_chains(4)] == [h(1), h(4), h(5), h(2)]
    assert [e.hash for e in disk.recent_chains(2)] == [h(1), h(4)]
    assert disk.recent_chains(0) == []
    # A hit makes its chain the most recent.
    disk.touch([h(1), h(2), h(3)], 60)
    assert [e.hash for e in disk.recent_chains(3)] == [h(1), h(2), h(3)]
    disk.check()
