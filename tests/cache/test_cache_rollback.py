"""Speculative tokens on the block table (issue 30): appended, never marked computed,
then cut back by ``truncate``. The pool, the refcounts and the prefix index never keep
anything of a rejected token."""

import pytest

from cache import KVCacheManager, Namespace

BS = 4
NS = Namespace(b"salt", label="t")


def make(num_blocks=16):
    return KVCacheManager(num_blocks, block_size=BS, debug_checks=True)


def decoded(mgr, seq_id, prompt):
    mgr.allocate(seq_id, prompt, NS)
    mgr.mark_computed(seq_id, len(prompt))


def test_rejected_tokens_return_their_blocks_and_are_never_indexed():
    mgr = make()
    decoded(mgr, "s", [1, 2, 3, 4, 5, 6])  # blocks: [1 2 3 4] [5 6 . .]
    free_before = mgr.num_free_blocks
    # The newest token 7 plus five proposals: positions 6..11, one fresh block and more.
    slots = mgr.append_slots("s", [7, 50, 51, 52, 53, 54]).slots
    assert len(slots) == 6 and len(mgr.block_table("s")) == 3
    assert mgr.num_free_blocks == free_before - 1
    # Verification kept 7 and proposal 50; the next token (not 51) has no KV yet.
    mgr.truncate("s", 8)
    mgr.mark_computed("s", 8)
    assert mgr.num_free_blocks == free_before  # the block of 51.. is back at once
    assert mgr.token_ids("s") == [1, 2, 3, 4, 5, 6, 7, 50]
    mgr.free("s")
    # Blocks [1 2 3 4] and [5 6 7 50] are indexed; nothing with a rejected token is.
    assert mgr.allocate("a", [1, 2, 3, 4, 5, 6, 7, 50, 9], NS).num_cached_tokens == 8
    rejected = [1, 2, 3, 4, 5, 6, 7, 50, 51, 52, 53, 54, 0]
    assert mgr.allocate("b", rejected, NS).num_cached_tokens == 8
    assert len(mgr.tiers.index.nodes) == 2  # the two verified blocks


def test_truncate_refuses_to_cut_computed_tokens_and_changes_nothing():
    mgr = make()
    decoded(mgr, "s", [1, 2, 3, 4, 5])
    mgr.append_slots("s", [6, 7])
    with pytest.raises(ValueError):
        mgr.truncate("s", 4)  # below num_computed (5)
    with pytest.raises(ValueError):
        mgr.truncate("s", 8)  # past the tokens
    assert mgr.token_ids("s") == [1, 2, 3, 4, 5, 6, 7]
    mgr.truncate("s", 5)
    assert mgr.token_ids("s") == [1, 2, 3, 4, 5] and len(mgr.block_table("s")) == 2


def test_a_shared_partial_block_copied_for_proposals_does_not_leak():
    mgr = make()
    decoded(mgr, "p", [1, 2, 3, 4, 5, 6])
    mgr.fork("p", "c")  # the partial block [5 6 . .] is shared
    shared = mgr.block_table("p")[1]
    free_before = mgr.num_free_blocks
    mgr.append_slots("c", [7, 8, 9, 10, 11])  # a copy of the shared block, one more block
    assert mgr.block_table("c")[1] != shared
    assert mgr.num_free_blocks == free_before - 2
    mgr.truncate("c", 7)  # only the newest token 7 was verified
    mgr.mark_computed("c", 7)
    assert mgr.num_free_blocks == free_before - 1  # the copy stays: it holds token 7
    assert mgr.tiers.device.refcounts[shared] == 1  # the parent's alone again
    mgr.free("c")
    mgr.free("p")
    assert not any(mgr.tiers.device.refcounts)  # integrity checks ran after every call


def test_num_append_blocks_counts_fresh_blocks_and_the_copy():
    mgr = make()
    decoded(mgr, "p", [1, 2, 3, 4, 5, 6])
    assert mgr.num_append_blocks(["p"], 2) == 0
    assert mgr.num_append_blocks(["p"], 3) == 1
    mgr.fork("p", "c")
    assert mgr.num_append_blocks(["c"], 1) == 1  # the copy of the shared partial block
    assert mgr.num_append_blocks(["c"], 7) == 3
