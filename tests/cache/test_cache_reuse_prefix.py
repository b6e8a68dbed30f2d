"""allocate(..., reuse_prefix=False): every prompt token computed, nothing else changes."""

from cache import KVCacheManager, Namespace

BS = 4
NS = Namespace(b"salt-a", label="a")


def make() -> KVCacheManager:
    return KVCacheManager(16, block_size=BS, debug_checks=True)


def test_a_prompt_that_needs_all_its_logits_maps_no_cached_block():
    mgr = make()
    prompt = list(range(12))
    mgr.allocate("warm", prompt, NS)
    mgr.mark_computed("warm", len(prompt))
    assert mgr.match_prefix(prompt, NS).num_cached_tokens == 8
    lookups = _lookups(mgr)

    cold = mgr.match_prefix(prompt, NS, reuse_prefix=False)
    assert (cold.num_cached_tokens, cold.num_pending_tokens) == (0, 0)
    assert cold.num_blocks_needed == 3
    result = mgr.allocate("scored", prompt, NS, reuse_prefix=False)
    assert result.num_cached_tokens == 0
    assert not set(mgr.block_table("scored")) & set(mgr.block_table("warm"))
    # Not a lookup: the hit-rate statistics are as they were.
    assert _lookups(mgr) == lookups
    mgr.mark_computed("scored", len(prompt))
    mgr.free("scored")
    mgr.free("warm")
    mgr.check_integrity()
    # Both computed the same blocks; the index still serves the next prompt.
    assert mgr.allocate("next", prompt, NS).num_cached_tokens == 8


def _lookups(mgr: KVCacheManager) -> dict:
    snapshot = mgr.stats_snapshot()
    return {k: snapshot[k] for k in ("lookups", "queried_tokens", "hit_tokens", "by_label")}
