"""Bad input raises a clear exception and leaves every piece of state unchanged."""

import copy

import pytest

from cache import (
    DuplicateSequenceError,
    KVCacheManager,
    Namespace,
    OutOfBlocksError,
    UnknownSequenceError,
)

NS = Namespace(b"salt", label="t")


def populated():
    mgr = KVCacheManager(6, block_size=4, num_host_blocks=2, debug_checks=True)
    mgr.allocate("a", [1, 2, 3, 4, 5, 6], NS)
    mgr.mark_computed("a", 6)
    mgr.allocate("b", [9, 9, 9, 9, 8], NS)
    mgr.mark_computed("b", 5)
    mgr.free("b")
    return mgr


def state(mgr):
    return (
        copy.deepcopy(mgr.stats_snapshot()),
        {
            s: (mgr.block_table(s), mgr.token_ids(s), mgr.num_computed_tokens(s))
            for s in mgr.seq_ids
        },
        list(mgr.tiers.device.refcounts),
        mgr.tiers.device.free_block_ids(),
        mgr.tiers.host.free_block_ids(),
    )


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda m: m.allocate("x", list(range(100)), NS), OutOfBlocksError, "needs 25"),
        (lambda m: m.allocate("a", [1, 2], NS), DuplicateSequenceError, "already allocated"),
        (lambda m: m.allocate("x", [], NS), ValueError, "at least one token"),
        (lambda m: m.allocate("x", [1, -1], NS), ValueError, "token ids"),
        (lambda m: m.allocate("x", [1, 2**32], NS), ValueError, "token ids"),
        (lambda m: m.allocate("x", [1, "2"], NS), ValueError, "token ids"),
        (lambda m: m.allocate("x", [1, 2], b"salt"), TypeError, "Namespace"),
        (lambda m: m.append_slots("nope", [1]), UnknownSequenceError, "unknown sequence"),
        (lambda m: m.append_slots("a", []), ValueError, "at least one"),
        (lambda m: m.append_slots("a", [1, 2.0]), ValueError, "token ids"),
        (lambda m: m.append_slots("a", list(range(40))), OutOfBlocksError, "append"),
        (lambda m: m.mark_computed("a", 7), ValueError, r"\[6, 6\]"),
        (lambda m: m.mark_computed("a", 2), ValueError, "num_tokens"),
        (lambda m: m.mark_computed("nope", 1), UnknownSequenceError, "unknown"),
        (lambda m: m.fork("nope", "c"), UnknownSequenceError, "unknown"),
        (lambda m: m.fork("a", "a"), DuplicateSequenceError, "already allocated"),
        (lambda m: m.free("b"), UnknownSequenceError, "already freed"),
        (lambda m: m.block_table("b"), UnknownSequenceError, "unknown"),
        (lambda m: m.num_blocks_needed([], NS), ValueError, "at least one"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, error, message):
    mgr = populated()
    before = state(mgr)
    with pytest.raises(error, match=message):
        call(mgr)
    assert state(mgr) == before
    mgr.check_integrity()


def test_double_free_raises_and_changes_nothing():
    mgr = populated()
    mgr.free("a")
    before = state(mgr)
    with pytest.raises(UnknownSequenceError):
        mgr.free("a")
    assert state(mgr) == before


def test_out_of_blocks_at_the_edge_is_exact():
    mgr = populated()  # a: 2 blocks held; b0 cached (evictable); 3 free
    assert mgr.num_blocks_needed(list(range(16)), NS) == 4
    assert mgr.can_allocate(4) and not mgr.can_allocate(5)
    before = state(mgr)
    with pytest.raises(OutOfBlocksError):
        mgr.allocate("x", list(range(17)), NS)
    assert state(mgr) == before
    mgr.allocate("x", list(range(16)), NS)
    assert mgr.stats_snapshot()["device"]["free"] == 0


def test_constructor_validation():
    with pytest.raises(ValueError, match="power of two"):
        KVCacheManager(4, block_size=12)
    with pytest.raises(ValueError, match="positive"):
        KVCacheManager(0)
    with pytest.raises(ValueError, match="num_host_blocks"):
        KVCacheManager(4, num_host_blocks=-1)


def test_integrity_check_reports_a_corrupted_refcount():
    from cache import CacheIntegrityError

    mgr = populated()
    mgr.tiers.device.refcounts[mgr.block_table("a")[0]] += 1
    with pytest.raises(CacheIntegrityError, match="refcount 2 but 1 table"):
        mgr.check_integrity()
