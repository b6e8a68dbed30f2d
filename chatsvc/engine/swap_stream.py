"""Host-tier swaps on a CUDA stream of their own (on CPU pools: plain block copies).

Ordering is kept with stream dependencies, not host syncs:

    compute stream  ... step N-1 kernels ──┐                ┌── step N kernels ...
    swap stream                            └─ wait ─ copies ─┘ (compute waits for them)

A swap-out reads a block the earlier kernels wrote, and a swap-in may fill a
block they last read, so the copies wait for the compute queued before them;
this step's kernels, which read swapped-in blocks, wait for the copies. The
host thread never waits: it goes on building and launching the step while the
copy engine moves the blocks. ``pairs`` is recorded on the swap stream, so the
caching allocator cannot reuse its memory while a copy still reads it.
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
