"""Random interleavings of every manager operation against a model of the KV data.

The model simulates the KV tensors: ``data[(tier, block, offset)]`` holds the
"KV" of a token, which is the token prefix it was computed from. The test
writes KV through the slots the manager hands out and applies every plan's
swap-outs, swap-ins and copies itself, so a plan that forgets a copy, a match
of an unwritten block or a block shared by mistake all show up as a sequence
reading the wrong content.
"""

import copy

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache import KVCacheManager, Namespace, OutOfBlocksError

SYSTEM = [7, 7, 3, 3, 5, 5, 1, 1]
NAMESPACES = [
    Namespace(b"A", shared_prefix_len=len(SYSTEM), label="a"),
    Namespace(b"B", shared_prefix_len=len(SYSTEM), label="b"),
    Namespace(b"A", label="a"),
]
tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=10)


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(6, 20),
        num_host_blocks=st.sampled_from([0, 0, 2, 6]),
        block_size=st.sampled_from([2, 4]),
        enable=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks, num_host_blocks, block_size, enable):
        self.bs = block_size
        self.mgr = KVCacheManager(
            num_blocks, block_size, num_host_blocks, enable_prefix_cache=enable, debug_checks=True
        )
        self.data = {}
        self.next_id = 0
        self.prompts = {}  # seq_id -> (prompt, namespace) of sequences made by allocate

    def _apply(self, plan):
        bs = self.bs
        for phase, src_tier, dst_tier in (
            (plan.swap_out, "d", "h"),
            (plan.swap_in, "h", "d"),
            (plan.copies, "d", "d"),
        ):
            for src, dst in phase:
                for offset in range(bs):
                    value = self.data.get((src_tier, src, offset))
                    if value is None:
                        self.data.pop((dst_tier, dst, offset), None)
                    else:
                        self.data[(dst_tier, dst, offset)] = value

    def _content(self, seq_id, position):
        return tuple(self.mgr.token_ids(seq_id)[: position + 1])

    def _slot_key(self, seq_id, position):
        block = self.mgr.block_table(seq_id)[position // self.bs]
        return ("d", block, position % self.bs)

    def _seq(self, data):
        ids = self.mgr.seq_ids
        return data.draw(st.sampled_from(sorted(ids, key=str))) if ids else None

    @rule(
        prefix=st.sampled_from([[], SYSTEM, SYSTEM + [0, 1, 2, 0]]),
        suffix=tokens_st,
        ns=st.sampled_from(NAMESPACES),
    )
    def allocate(self, prefix, suffix, ns):
        tokens = prefix + suffix or [0]
        seq_id = self.next_id
        self.next_id += 1
        needed = self.mgr.num_blocks_needed(tokens, ns)
        match = self.mgr.match_prefix(tokens, ns)
        assert match.num_blocks_needed == needed
        assert match.num_cached_tokens == self.mgr.num_matched_tokens(tokens, ns)
        if not self.mgr.can_allocate(needed):
            before = copy.deepcopy(self.mgr.stats_snapshot())
            try:
                self.mgr.allocate(seq_id, tokens, ns)
            except OutOfBlocksError:
                assert self.mgr.stats_snapshot() == before
                return
            raise AssertionError("allocate succeeded although can_allocate said no")
        result = self.mgr.allocate(seq_id, tokens, ns)
        self._apply(result.plan)
        self.prompts[seq_id] = (tokens, ns)
        assert result.num_cached_tokens == match.num_cached_tokens
        assert result.num_cached_tokens % self.bs == 0
        assert result.num_cached_tokens < len(tokens)
        assert self.mgr.num_computed_tokens(seq_id) == result.num_cached_tokens

    @precondition(lambda self: self.mgr.seq_ids)
    @rule(data=st.data(), max_tokens=st.integers(1, 12))
    def compute(self, data, max_tokens):
        seq_id = self._seq(data)
        start = self.mgr.num_computed_tokens(seq_id)
        end = min(self.mgr.num_tokens(seq_id), start + max_tokens)
        for position in range(start, end):
            self.data[self._slot_key(seq_id, position)] = self._content(seq_id, position)
        self.mgr.mark_computed(seq_id, end)

    @precondition(lambda self: self.mgr.seq_ids)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def append(self, data, tokens):
        seq_id = self._seq(data)
        try:
            result = self.mgr.append_slots(seq_id, tokens)
        except OutOfBlocksError:
            return
        self._apply(result.plan)
        start = self.mgr.num_tokens(seq_id) - len(tokens)
        table = self.mgr.block_table(seq_id)
        expected = [
            table[p // self.bs] * self.bs + p % self.bs for p in range(start, start + len(tokens))
        ]
        assert result.slots == expected

    @precondition(lambda self: self.mgr.seq_ids)
    @rule(data=st.data())
    def fork(self, data):
        parent = self._seq(data)
        child = self.next_id
        self.next_id += 1
        self.mgr.fork(parent, child)
        assert self.mgr.block_table(child) == self.mgr.block_table(parent)

    @precondition(lambda self: self.mgr.seq_ids)
    @rule(data=st.data())
    def append_each(self, data):
        # One token to each of several sequences (a beam search's step): the blocks
        # num_append_blocks predicts are exactly the blocks the appends take.
        ids = sorted(self.mgr.seq_ids, key=str)
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=4, unique=True))
        needed = self.mgr.num_append_blocks(chosen)
        if not self.mgr.can_allocate(needed):
            return
        available = self.mgr.tiers.num_available
        for seq_id in chosen:
            self._apply(self.mgr.append_slots(seq_id, [1]).plan)
        assert available - self.mgr.tiers.num_available == needed

    @precondition(lambda self: self.mgr.seq_ids)
    @rule(data=st.data())
    def stop_indexing(self, data):
        seq_id = self._seq(data)
        self.mgr.stop_indexing(seq_id)
        self.prompts.pop(seq_id, None)  # its later blocks are never cached

    @precondition(lambda self: self.mgr.seq_ids)
    @rule(data=st.data())
    def free(self, data):
        seq_id = self._seq(data)
        self.mgr.free(seq_id)
        self.prompts.pop(seq_id, None)

    @rule(size=st.integers(1, 40))
    def pressure(self, size):
        # A throwaway prompt that forces evictions (and swaps with a host tier).
        tokens = [3 + (i % 5) for i in range(size)]
        if not self.mgr.can_allocate(self.mgr.num_blocks_needed(tokens, NAMESPACES[2])):
            return
        seq_id = self.next_id
        self.next_id += 1
        self._apply(self.mgr.allocate(seq_id, tokens, NAMESPACES[2]).plan)
        self.mgr.free(seq_id)

    @invariant()
    def live_prompts_are_cached_or_pending(self):
        # A live prompt's full blocks are indexed once computed (by it or by another
        # sequence) and announced as pending before that: a probe one token longer
        # sees every one of them as either cached or pending.
        if not hasattr(self, "mgr") or not self.mgr.enable_prefix_cache:
            return
        for prompt, ns in self.prompts.values():
            match = self.mgr.match_prefix(prompt + [0], ns)
            full = len(prompt) // self.bs * self.bs
            assert match.num_cached_tokens + match.num_pending_tokens == full, (
                f"prompt of {len(prompt)} tokens: {match.num_cached_tokens} cached + "
                f"{match.num_pending_tokens} pending, expected {full}"
            )

    @invariant()
    def every_sequence_sees_its_own_kv(self):
        if not hasattr(self, "mgr"):
            return
        self.mgr.check_integrity()
        for seq_id in self.mgr.seq_ids:
            for position in range(self.mgr.num_computed_tokens(seq_id)):
                assert self.data.get(self._slot_key(seq_id, position)) == self._content(
                    seq_id, position
                ), f"seq {seq_id} position {position} reads foreign or missing KV"

    def teardown(self):
        if hasattr(self, "mgr"):
            for seq_id in self.mgr.seq_ids:
                self.mgr.free(seq_id)
            snap = self.mgr.stats_snapshot()["device"]
            assert snap["used"] == 0 and snap["free"] + snap["cached"] == snap["total"]


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=400,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
