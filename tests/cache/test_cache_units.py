"""Unit tests for the small pieces: pool, table, namespace, hashing, stats, index."""

import pytest

import cache.hashing
from cache import (
    BlockChain,
    BlockHasher,
    BlockPool,
    BlockTable,
    ChainBlock,
    KVCacheManager,
    Namespace,
    OutOfBlocksError,
    PrefixIndex,
)
from cache.hashing import ROOT_HASH
from cache.namespace import PUBLIC, PUBLIC_KEY
from cache.stats import CacheStats


def test_pool_hands_out_in_order_and_reuses_last_freed_first():
    pool = BlockPool(4)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    pool.decref(1)
    pool.release(1)
    pool.decref(0)
    pool.release(0)
    assert pool.allocate() == 0
    assert pool.allocate() == 1
    assert pool.num_free == 1


def test_pool_refcounts_and_errors_leave_state_unchanged():
    pool = BlockPool(2)
    block = pool.allocate()
    assert pool.incref(block) == 2
    assert pool.decref(block) == 1
    with pytest.raises(ValueError, match="still has 1 reference"):
        pool.release(block)
    assert pool.decref(block) == 0
    with pytest.raises(ValueError, match="no reference"):
        pool.decref(block)
    pool.release(block)
    with pytest.raises(ValueError, match="already free"):
        pool.release(block)
    with pytest.raises(ValueError, match="is free"):
        pool.incref(block)
    assert pool.num_free == 2 and pool.refcounts == [0, 0]
    pool.allocate()
    pool.allocate()
    with pytest.raises(OutOfBlocksError):
        pool.allocate()
    assert pool.num_free == 0


def test_pool_rejects_bad_size():
    with pytest.raises(ValueError):
        BlockPool(-1)


def test_block_table_slots_and_replace():
    table = BlockTable()
    table.append(7)
    table.append(3)
    assert table.slot(0, 4) == 28 and table.slot(5, 4) == 13
    assert table.replace(1, 9) == 3
    copy = table.copy()
    copy.append(1)
    assert len(table) == 2 and table.block_ids == [7, 9]


def test_namespace_public_blocks_end_before_the_straddling_block():
    ns = Namespace(b"salt", shared_prefix_len=40, label="t")
    # block size 16: blocks 0 and 1 lie wholly inside 40 tokens, block 2 straddles
    assert [ns.is_public(i, 16) for i in range(4)] == [True, True, False, False]
    assert ns.key(0, 16) == PUBLIC_KEY
    assert ns.key(2, 16) == ns.private_key != PUBLIC_KEY
    assert ns.stats_label(1, 16) == "public" and ns.stats_label(2, 16) == "t"
    assert Namespace(b"", 0).key(0, 16) != PUBLIC_KEY  # an empty salt is still private
    assert PUBLIC.is_public(10**6, 16)


def test_namespace_validates_and_is_hashable():
    with pytest.raises(TypeError):
        Namespace("not bytes")
    with pytest.raises(ValueError):
        Namespace(b"x", shared_prefix_len=-1)
    assert Namespace(b"x", 3, "a") == Namespace(b"x", 3, "a")
    assert len({Namespace(b"x"), Namespace(b"x"), Namespace(b"y")}) == 2


def test_hash_chains_over_parent_tokens_and_namespace():
    hasher = BlockHasher(4)
    h = hasher.hash_block(ROOT_HASH, (1, 2, 3, 4), b"\x01a")
    assert len(h) == 16
    assert h == hasher.hash_block(ROOT_HASH, [1, 2, 3, 4], b"\x01a")
    assert h != hasher.hash_block(ROOT_HASH, (1, 2, 3, 5), b"\x01a")
    assert h != hasher.hash_block(ROOT_HASH, (1, 2, 3, 4), b"\x01b")
    assert hasher.hash_block(h, (1, 2, 3, 4), b"\x01a") != h
    with pytest.raises(ValueError):
        hasher.hash_block(ROOT_HASH, (1, 2, 3), b"")
    with pytest.raises(ValueError):
        hasher.hash_block(ROOT_HASH, (1, 2, 3, 2**32), b"")


def test_index_lookup_verifies_tokens_namespace_and_parent():
    index = PrefixIndex()
    node = index.insert(index.root, b"h" * 16, (1, 2), b"ns", 5)
    assert index.lookup(index.root, b"h" * 16, (1, 2), b"ns") is node
    assert index.lookup(index.root, b"h" * 16, (1, 3), b"ns") is None
    assert index.lookup(index.root, b"h" * 16, (1, 2), b"other") is None
    assert index.lookup(node, b"h" * 16, (1, 2), b"ns") is None
    with pytest.raises(ValueError):
        index.insert(index.root, b"h" * 16, (1, 2), b"ns", 6)
    child = index.insert(node, b"c" * 16, (3, 4), b"ns", 6)
    with pytest.raises(ValueError):
        index.remove(node)
    index.remove(child)
    assert len(index) == 1 and node.num_device_children == 0


def test_index_device_victims_come_out_least_recently_used_first():
    index = PrefixIndex()
    refcounts = [0] * 4
    nodes = []
    for i, tick in enumerate([5, 2, 9]):
        index.tick = tick
        nodes.append(index.insert(index.root, bytes([i]) * 16, (i,), b"", i))
        index.push_device_candidate(nodes[-1])
    refcounts[1] = 1  # referenced: skipped
    assert index.pop_device_victim(refcounts) is nodes[0]
    nodes[2].last_access = 11  # touched after the push: its entry is stale
    assert index.pop_device_victim(refcounts) is None


def test_stats_histogram_buckets():
    stats = CacheStats()
    for hits in range(5):
        stats.record_hit("t", 16, hits)  # one block reused 5 times
    stats.record_hit("public", 16, 0)  # another reused once
    assert stats.reuse_histogram() == {"1": 1, "5-8": 1}
    snap = stats.snapshot()
    assert snap["hit_blocks"] == 6 and snap["by_label"]["public"]["hit_tokens"] == 16


def test_block_chain_hashes_each_block_once_and_keeps_them_as_it_grows(monkeypatch):
    ns = Namespace(b"salt", shared_prefix_len=4)
    tokens = list(range(10))
    hasher = BlockHasher(4)
    expected, parent = [], ROOT_HASH
    for i in range(3):
        block = (tokens + [10, 11])[i * 4 : (i + 1) * 4]
        parent = hasher.hash_block(parent, block, ns.key(i, 4))
        expected.append(parent)

    calls = []
    real = cache.hashing._digest
    monkeypatch.setattr(cache.hashing, "_digest", lambda data: calls.append(data) or real(data))
    chain = BlockChain(hasher, tokens, ns)
    assert (chain.num_full_blocks, chain.num_matchable_blocks) == (2, 2)
    first = next(chain.blocks(0, 2))  # a walk that stops early hashes no further
    assert first == ChainBlock(0, expected[0], ROOT_HASH, (0, 1, 2, 3), PUBLIC_KEY)
    assert len(calls) == 1
    assert [b.hash for b in chain.blocks(0, 2)] == expected[:2] and len(calls) == 2
    assert chain.block(1).parent_hash == expected[0] and len(calls) == 2

    twin = chain.copy()
    chain.extend([10, 11])
    assert chain.num_full_blocks == 3 and chain.num_matchable_blocks == 2
    assert chain.hash(2) == expected[2]
    assert len(calls) == 3 and twin.num_tokens == 10
    with pytest.raises(IndexError):
        twin.hash(2)
    with pytest.raises(ValueError):
        chain.extend([2**32])
    with pytest.raises(ValueError):
        BlockChain(hasher, [1, -1], ns)
    with pytest.raises(TypeError):
        BlockChain(hasher, [1], "public")
    assert chain.num_tokens == 12  # a refused extend appends nothing


def test_a_prompt_chain_is_hashed_once_from_the_queries_to_its_indexing(monkeypatch):
    calls = []
    real = cache.hashing._digest
    monkeypatch.setattr(cache.hashing, "_digest", lambda data: calls.append(data) or real(data))
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    prompt = mgr.chain(list(range(18)), PUBLIC)  # 4 full blocks, the 5th partial
    assert mgr.num_matched_tokens(prompt, PUBLIC) == 0
    assert mgr.match_prefix(prompt, PUBLIC).num_blocks_needed == 5
    mgr.allocate("a", prompt, PUBLIC)
    mgr.mark_computed("a", 18)
    assert len(calls) == 4
    assert mgr.num_matched_tokens(prompt, PUBLIC) == 16 and len(calls) == 4
    with pytest.raises(ValueError):
        mgr.allocate("b", prompt, Namespace(b"another tenant"))
    assert "b" not in mgr
