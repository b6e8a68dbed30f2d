"""Host-tier swaps on a CUDA stream of their own (on CPU pools: plain block copies).

Ordering is kept with stream dependencies, not host syncs:

    compute stream  ... step N-1 kernels ──┐                ┌── step N kernels ...
    swap stream                            └─ wait ─ copies ─┘ (compute waits for them)

A swap-out reads a block the earlier kernels wrote, and a swap-in may fill a
block they last read, so the copies wait for the compute queued before them;
this step's kernels, which read swapped-in blocks, wait for the copies. The
host thread never blocks: it goes on building the step's batch while the copy
engine moves the blocks, and compute kernels of earlier steps still running
are overlapped by nothing but the copies' own queueing. Tensors used on the
swap stream are recorded on it, so the caching allocator cannot hand their
memory out while a copy still reads them.
"""

from __future__ import annotations

import torch

from kernels import copy_blocks


class SwapStream:
    """``copy(src_pool, dst_pool, pairs)`` for tier swaps on ``device``."""

    def __init__(self, device: torch.device) -> None:
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: torch.Tensor) -> None:
        if self.stream is None:
            copy_blocks(src_pool, dst_pool, pairs)
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            copy_blocks(src_pool, dst_pool, pairs)
        if pairs.is_cuda:
            pairs.record_stream(self.stream)
        compute.wait_stream(self.stream)
