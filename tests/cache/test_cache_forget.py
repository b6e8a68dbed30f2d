"""Forgetting a session keeps exactly the blocks another session uses (``owners``),
in memory and on disk, without being told which sessions exist."""

from cache import KVCacheManager
from cache.forget import owner_digest
from tests.cache.test_cache_disk_index import BS, TENANT, chain_hashes, make, persist, run_prompt

A, B, C = (owner_digest(b"salt-a", name) for name in "ABC")
A_TOKENS = list(range(100, 112))  # three full blocks
B_TOKENS = A_TOKENS[:8] + [7]  # began like A: its stored history is a prefix of A's


def test_a_block_another_session_matched_stays_until_that_session_goes_too():
    mgr = KVCacheManager(16, block_size=BS, debug_checks=True)
    run_prompt(mgr, "a", A_TOKENS, owner=A)
    run_prompt(mgr, "b", B_TOKENS, owner=B)  # matches A's first two blocks
    mgr.free("a")
    mgr.free("b")
    result = mgr.forget(A_TOKENS, TENANT, A)
    # Nothing hangs below B's blocks and no store was asked: only owners tell.
    assert (result.device_blocks, result.kept_blocks) == (1, 2)
    assert mgr.num_matched_tokens(B_TOKENS, TENANT) == 8
    assert mgr.num_matched_tokens(A_TOKENS, TENANT) == 8
    mgr.check_integrity()
    # A no longer counts as a user: B's delete takes the rest.
    assert mgr.forget(B_TOKENS, TENANT, B).device_blocks == 2
    assert mgr.num_matched_tokens(A_TOKENS, TENANT) == 0
    mgr.check_integrity()


def test_the_owners_follow_a_block_to_disk():
    mgr, disk = make(num_blocks=4)
    run_prompt(mgr, "a", A_TOKENS, owner=A)
    run_prompt(mgr, "b", B_TOKENS, owner=B)
    persist(mgr, disk, mgr.take_stores())
    mgr.free("a")
    mgr.free("b")
    run_prompt(mgr, "c", list(range(300, 316)), owner=C)  # pushes A's and B's out of memory
    persist(mgr, disk, mgr.take_stores())
    mgr.free("c")
    a_chain = chain_hashes(A_TOKENS)
    assert mgr.num_matched_tokens(A_TOKENS, TENANT) == 0 and all(x in disk for x in a_chain)
    result = mgr.forget(A_TOKENS, TENANT, A)
    assert [e.hash for e in result.disk_blocks] == a_chain[2:]
    assert a_chain[0] in disk and a_chain[1] in disk
    result = mgr.forget(B_TOKENS, TENANT, B)
    assert [e.hash for e in result.disk_blocks] == a_chain[1::-1]
    mgr.check_integrity()


def test_a_running_sequence_of_the_session_keeps_it_among_the_owners():
    mgr = KVCacheManager(16, block_size=BS, debug_checks=True)
    run_prompt(mgr, "a", A_TOKENS, owner=A)
    mgr.free("a")
    run_prompt(mgr, "a2", A_TOKENS + [1], owner=A)  # A's next turn, still running
    assert mgr.forget(A_TOKENS, TENANT, A, owned_below=False).device_blocks == 0
    mgr.check_integrity()  # a2's owner is still among its blocks' owners
    mgr.free("a2")
    assert mgr.forget(A_TOKENS, TENANT, A).device_blocks == 3
    mgr.check_integrity()
