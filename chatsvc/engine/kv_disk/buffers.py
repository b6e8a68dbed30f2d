"""Byte views of pool blocks, and the fixed set of buffers block snapshots go into.

A write never reads the pool from the I/O thread: the block may be evicted and
reused before the write runs. The engine thread copies it into a snapshot
buffer first (a memcpy on CPU; an asynchronous device-to-host copy into pinned
memory on CUDA). The buffers are allocated once; when all are in use a store
is dropped, so a slow disk can never make the engine wait or grow memory.
"""

from __future__ import annotations

import threading

import torch


def block_bytes(pool: torch.Tensor, block: int) -> torch.Tensor:
    """Block ``block`` of a pool as a flat uint8 view (a block is one contiguous chunk)."""
    return pool[block].view(torch.uint8).reshape(-1)


class PoolBlock:
    """A CPU pool block as a writable buffer: loads read straight into it."""

    def __init__(self, pool: torch.Tensor, block: int) -> None:
        self.tensor = block_bytes(pool, block)
        self.view = memoryview(self.tensor.numpy())


class SnapshotBuffer:
    """One buffer of a BufferPool; ``release`` hands it back (from any thread)."""

    def __init__(self, owner: BufferPool, tensor: torch.Tensor) -> None:
        self._owner = owner
        self.tensor = tensor
        self.view = memoryview(tensor.numpy())

    def release(self) -> None:
        self._owner.give_back(self)


class BufferPool:
    """``count`` buffers of ``nbytes`` each (pinned when CUDA is present)."""

    def __init__(self, count: int, nbytes: int, pin: bool = False) -> None:
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._free = [
            SnapshotBuffer(self, torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))
            for _ in range(count)
        ]
        self.count = count

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def take(self) -> SnapshotBuffer | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def give_back(self, buffer: SnapshotBuffer) -> None:
        with self._lock:
            self._free.append(buffer)
