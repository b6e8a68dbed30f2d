"""Turns a scheduled step into tensors, runs the cache's block copies and the model.

Per step, in order:
1. every CachePlan of the step, call by call: swap_out (device -> host),
   swap_in (host -> device), copies (device -> device, copy-on-write);
2. one forward pass over the new tokens of all scheduled sequences;
3. ``mark_computed`` for each sequence, so its newly full blocks join the index
   only once their KV is really written.
It hands back the logits rows of sequences whose every token now has KV; rows of
intermediate prefill chunks are dropped (nothing to sample there).
"""

from __future__ import annotations

import torch

from cache import CachePlan, KVCacheManager
from chatsvc.engine.forward_batch import ForwardBatch
from chatsvc.engine.llama import LlamaModel
from chatsvc.engine.scheduler import ScheduledSequence, SchedulerOutput
from chatsvc.engine.swap_stream import SwapStream
from kernels import copy_blocks
from kernels.kv_layout import new_kv_pool


class ModelRunner:
    """Owns the device KV pool (and the host pool when there is a host tier)."""

    def __init__(
        self, model: LlamaModel, block_size: int, num_gpu_blocks: int, num_host_blocks: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        shape = model.kv_shape(block_size)
        self.kv_pool = new_kv_pool(num_gpu_blocks, shape, model.dtype, model.device)
        self.host_pool = (
            new_kv_pool(num_host_blocks, shape, model.dtype, "cpu", pin_memory=True)
            if num_host_blocks
            else None
        )
        # Set by the disk tier (chatsvc.engine.kv_disk): copy blocks a plan drops
        # from memory out before the plan reuses them, and start the step's disk
        # loads once its plans have run.
        self.store_blocks = None
        self.after_plans = None
        # Tier swaps on their own CUDA stream, ordered by stream waits (swap_stream.py).
        self.swaps = SwapStream(self.kv_pool.device)

    def execute_plan(self, plan: CachePlan) -> None:
        """Run one plan's copies in the order the cache requires."""
        if plan.stores and self.store_blocks is not None:
            self.store_blocks(plan.stores)
        if plan.swap_out or plan.swap_in:
            if self.host_pool is None:
                raise RuntimeError("the cache planned a host swap but there is no host pool")
        if plan.swap_out:
            self.swaps.copy(self.kv_pool, self.host_pool, _pairs(plan.swap_out))
        if plan.swap_in:
            self.swaps.copy(self.host_pool, self.kv_pool, _pairs(plan.swap_in))
        if plan.copies:
            copy_blocks(self.kv_pool, self.kv_pool, _pairs(plan.copies))

    def execute(
        self, out: SchedulerOutput, cache: KVCacheManager
    ) -> tuple[list[ScheduledSequence], torch.Tensor | None]:
        """Run a step; returns the completing sequences and their logits ``[N, vocab]`` (fp32)."""
        for plan in out.plans:
            self.execute_plan(plan)
        if self.after_plans is not None:
            self.after_plans(out)
        if not out.scheduled:
            return [], None
        token_ids, num_computed, slots, tables = [], [], [], []
        for item in out.scheduled:
            seq = item.seq
            token_ids.append(
                [seq.token_at(p) for p in range(item.start, item.start + item.num_new_tokens)]
            )
            num_computed.append(item.start)
            slots.append(item.slots)
            tables.append(cache.block_table(seq.seq_id))
        batch = ForwardBatch.from_lists(
            token_ids, num_computed, slots, tables, self.block_size, self.model.device
        )
        logits = self.model.forward(batch, self.kv_pool)  # [B, vocab]
        for item in out.scheduled:
            done = item.start + item.num_new_tokens
            cache.mark_computed(item.seq.seq_id, done)
            item.seq.num_computed_tokens = done
        rows = [i for i, item in enumerate(out.scheduled) if item.completes]
        if not rows:
            return [], None
        if len(rows) < len(out.scheduled):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        return [out.scheduled[i] for i in rows], logits


def _pairs(pairs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
