"""Turns a scheduled step into tensors, runs the cache's block copies and the model.

Per step, in order:
1. ``execute_plans``: every CachePlan of the step, call by call: stores
   (to the step's I/O: blocks leaving memory for the disk tier), swap_out
   (device -> host), swap_in (host -> device), copies (device -> device,
   copy-on-write);
2. ``forward``: one forward pass over the new tokens of the scheduled sequences;
3. ``completing_rows``: the logits rows of sequences whose every token now has
   KV; rows of intermediate prefill chunks are dropped (nothing to sample there).

The runner changes no bookkeeping: ``Scheduler.update_from_step`` marks the
tokens computed after the forward. So a failed forward can be run again on
fewer sequences: ``forward`` writes K/V only into the slots of its own
sequences' new tokens, running it again (the plans are not run twice) rewrites
the same slots, and nothing is marked computed until the scheduler is told.
"""

from __future__ import annotations

import torch

from cache import CachePlan, KVCacheManager
from chatsvc.engine.forward_batch import ForwardBatch
from chatsvc.engine.llama import LlamaModel
from chatsvc.engine.prompt_logprobs import num_logit_rows
from chatsvc.engine.scheduler_output import ScheduledSequence, keep_rows
from chatsvc.engine.step_io import StepIO
from chatsvc.engine.swap_stream import SwapStream
from kernels import copy_blocks
from kernels.kv_layout import new_kv_pool


class ModelRunner:
    """Owns the device KV pool (and the host pool when there is a host tier)."""

    def __init__(
        self,
        model: LlamaModel,
        block_size: int,
        num_gpu_blocks: int,
        num_host_blocks: int = 0,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """``kv_dtype``: what the pools store (None: the model's dtype; int8: rows with
        scales, ``kernels.kv_layout``). Both tiers hold the same, so a swap is a block copy."""
        self.model = model
        self.block_size = block_size
        shape = model.kv_shape(block_size)
        kv_dtype = kv_dtype or model.dtype
        self.kv_pool = new_kv_pool(num_gpu_blocks, shape, kv_dtype, model.device)
        self.host_pool = (
            new_kv_pool(num_host_blocks, shape, kv_dtype, "cpu", pin_memory=True)
            if num_host_blocks
            else None
        )
        # Tier swaps on their own CUDA stream, ordered by stream waits (swap_stream.py).
        self.swaps = SwapStream(self.kv_pool.device)

    def execute_plan(self, plan: CachePlan, io: StepIO) -> None:
        """Run one plan's copies in the order the cache requires; its stores go to ``io``
        first, while the blocks still hold what they name."""
        if plan.stores:
            io.store(plan.stores)
        if plan.swap_out or plan.swap_in:
            if self.host_pool is None:
                raise RuntimeError("the cache planned a host swap but there is no host pool")
        if plan.swap_out:
            self.swaps.copy(self.kv_pool, self.host_pool, _pairs(plan.swap_out))
        if plan.swap_in:
            self.swaps.copy(self.host_pool, self.kv_pool, _pairs(plan.swap_in))
        if plan.copies:
            copy_blocks(self.kv_pool, self.kv_pool, _pairs(plan.copies))

    def execute_plans(self, plans: list[CachePlan], io: StepIO) -> None:
        """Run the step's cache plans, in order; once per step, before any forward."""
        for plan in plans:
            self.execute_plan(plan, io)

    def forward(self, items: list[ScheduledSequence], cache: KVCacheManager) -> torch.Tensor:
        """Logits ``[R, vocab]`` (fp32): ``num_logit_rows(item)`` rows per item, in item order,
        each item's last new token last (one row per item unless prompt logprobs are asked).

        Writes the items' K/V into their slots and nothing else: the cache's
        bookkeeping and ``num_computed_tokens`` stay as they were
        (``Scheduler.update_from_step`` advances them).
        """
        token_ids, num_computed, slots, tables = [], [], [], []
        for item in items:
            seq = item.seq
            token_ids.append(
                [item.token_at(p) for p in range(item.start, item.start + item.num_new_tokens)]
            )
            num_computed.append(item.start)
            slots.append(item.slots)
            tables.append(cache.block_table(seq.seq_id))
        batch = ForwardBatch.from_lists(
            token_ids,
            num_computed,
            slots,
            tables,
            self.block_size,
            self.model.device,
            num_logits=[num_logit_rows(item) for item in items],
        )
        return self.model.forward(batch, self.kv_pool)  # [R, vocab]

    def forward_each(
        self, items: list[ScheduledSequence], cache: KVCacheManager
    ) -> list[torch.Tensor | Exception]:
        """Each item alone: its logits rows (``forward`` of that item), or the exception its
        pass raised.

        For a batch whose ``forward`` failed: the items that fail alone are the
        culprits. The same effects per item as ``forward`` (its own slots, no bookkeeping).
        """
        results: list[torch.Tensor | Exception] = []
        for item in items:
            try:
                results.append(self.forward([item], cache))
            except Exception as error:  # noqa: BLE001 - handed back as this item's result
                results.append(error)
        return results

    @staticmethod
    def completing_rows(
        items: list[ScheduledSequence], logits: torch.Tensor
    ) -> tuple[list[ScheduledSequence], torch.Tensor | None]:
        """The items whose every token now has KV, and their logits rows.

        ``logits`` holds ``item.num_rows`` rows per item, in item order (one unless the
        item is a speculative decode); the rows of intermediate prefill chunks are
        dropped (nothing to sample there).
        """
        kept, logits = keep_rows(items, logits, lambda item: item.completes)
        return (kept, logits) if kept else ([], None)


def _pairs(pairs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
