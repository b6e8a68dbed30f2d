"""The cache state machine (test_cache_stateful.py) over real int8 KV pools.

Beside the symbolic model of the KV data, the machine keeps a device pool and a host
pool of int8 KV (``kernels.kv_layout``: rows with a scale per token and head, the scales
inside their block), writes every computed token's K/V through the native KV write
(quantizing), and runs every plan's swap-outs, swap-ins and copy-on-write copies with
``kernels.copy_blocks``, as the engine does. After every step each sequence must read,
at each computed position of each layer, the very rows *and scales* its own tokens
wrote: a copy that moved the rows but not the scales, or a scale left behind by a
swap, reads as another token's values.
"""

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from test_cache_stateful import CacheMachine

import kernels
from kernels.kv_layout import KVShape, layer_kv, new_kv_pool
from kernels.kv_quant import quantize_rows

LAYERS, HEADS, DIM = 2, 2, 64


def token_kv(content: tuple[int, ...]) -> torch.Tensor:
    """The K/V a token computed from ``content`` (its prefix) writes: ``[L, 2, H, D]``
    fp32, of a magnitude that differs from token to token (so are the scales)."""
    gen = torch.Generator().manual_seed(hash(content) & 0xFFFF_FFFF)
    magnitude = 10.0 ** float(torch.empty(()).uniform_(-3, 3, generator=gen))
    return torch.randn(LAYERS, 2, HEADS, DIM, generator=gen) * magnitude


class KVBytesMachine(CacheMachine):
    @initialize(
        num_blocks=st.integers(6, 20),
        num_host_blocks=st.sampled_from([0, 2, 6]),
        block_size=st.sampled_from([2, 4]),
        enable=st.sampled_from([True, True, False]),
    )
    def setup(self, num_blocks, num_host_blocks, block_size, enable):
        super().setup(num_blocks, num_host_blocks, block_size, enable)
        shape = KVShape(LAYERS, block_size, HEADS, DIM)
        self.pools = {"d": new_kv_pool(num_blocks, shape, torch.int8, "cpu")}
        if num_host_blocks:
            self.pools["h"] = new_kv_pool(num_host_blocks, shape, torch.int8, "cpu")
        self.expected = {}  # content -> per layer and K/V: (rows, scales)

    def _apply(self, plan):
        super()._apply(plan)
        for phase, src, dst in (
            (plan.swap_out, "d", "h"),
            (plan.swap_in, "h", "d"),
            (plan.copies, "d", "d"),
        ):
            if phase:
                pairs = torch.tensor(phase, dtype=torch.int64).view(-1, 2)
                kernels.copy_blocks(self.pools[src], self.pools[dst], pairs)

    def _write(self, seq_id, start, end):
        """The real K/V of positions [start, end) of a sequence, through the native write."""
        contents = [self._content(seq_id, p) for p in range(start, end)]
        rows = torch.stack([token_kv(c) for c in contents])  # [T, L, 2, H, D]
        table = self.mgr.block_table(seq_id)
        slots = torch.tensor(
            [table[p // self.bs] * self.bs + p % self.bs for p in range(start, end)]
        )
        for layer in range(LAYERS):
            k, v, scales = layer_kv(self.pools["d"], layer)
            key, value = rows[:, layer, 0], rows[:, layer, 1]
            kernels.write_kv(k, v, key, value, slots, backend="native", scales=scales)

    @precondition(lambda self: self.mgr.seq_ids)
    @rule(data=st.data(), max_tokens=st.integers(1, 12))
    def compute(self, data, max_tokens):
        seq_id = self._seq(data)
        start = self.mgr.num_computed_tokens(seq_id)
        end = min(self.mgr.num_tokens(seq_id), start + max_tokens)
        for position in range(start, end):
            self.data[self._slot_key(seq_id, position)] = self._content(seq_id, position)
        if end > start:
            self._write(seq_id, start, end)
        self.mgr.mark_computed(seq_id, end)

    def _expected(self, content):
        if content not in self.expected:
            self.expected[content] = quantize_rows(token_kv(content))  # [L, 2, H, D], [L, 2, H]
        return self.expected[content]

    @invariant()
    def every_sequence_reads_its_own_rows_and_scales(self):
        if not hasattr(self, "mgr"):
            return
        pool = self.pools["d"]
        views = [layer_kv(pool, layer) for layer in range(LAYERS)]
        for seq_id in self.mgr.seq_ids:
            table = self.mgr.block_table(seq_id)
            for position in range(self.mgr.num_computed_tokens(seq_id)):
                block, offset = table[position // self.bs], position % self.bs
                rows, scales = self._expected(self._content(seq_id, position))
                for layer, (k, v, kv_scales) in enumerate(views):
                    got = (k[block, offset], v[block, offset])
                    got_scales = (kv_scales.k[block, offset], kv_scales.v[block, offset])
                    for kv in (0, 1):
                        assert torch.equal(got[kv], rows[layer, kv]), (
                            f"seq {seq_id} position {position} layer {layer}: foreign rows"
                        )
                        assert torch.equal(got_scales[kv], scales[layer, kv]), (
                            f"seq {seq_id} position {position} layer {layer}: foreign scales"
                        )


TestKVBytesMachine = KVBytesMachine.TestCase
TestKVBytesMachine.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
