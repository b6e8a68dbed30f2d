"""A fixed set of physical blocks with refcounts and a LIFO free list.

Block states, as far as the pool knows them:

    free        on the free list, refcount 0
    held        refcount > 0 (block tables, or a host-tier node, hold it)
    parked      refcount 0 but not on the free list: the owner (the prefix
                index) keeps its data as a cached block until it is released

The pool never decides to release a block by itself: ``decref`` reports the
new count and the caller either ``release``\\ s the block or parks it.
Everything is O(1); ``_is_free`` makes double releases detectable in O(1).
"""

from __future__ import annotations

from .errors import OutOfBlocksError


class BlockPool:
    """``num_blocks`` physical blocks ``0 .. num_blocks-1``.

    ``refcounts`` is a public list so hot paths can read a count without a call;
    it must only be changed through the methods.
    """

    __slots__ = ("num_blocks", "refcounts", "_free", "_is_free", "name")

    def __init__(self, num_blocks: int, name: str = "device") -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        self.name = name
        self.num_blocks = num_blocks
        self.refcounts = [0] * num_blocks
        # Reversed so that a fresh pool hands out 0, 1, 2, ... in order.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free list, next block to be handed out last (a copy)."""
        return list(self._free)

    def is_free(self, block_id: int) -> bool:
        return bool(self._is_free[block_id])

    def allocate(self) -> int:
        """Take the most recently released block; its refcount becomes 1."""
        if not self._free:
            raise OutOfBlocksError(1, 0, f"{self.name} pool")
        block_id = self._free.pop()
        self._is_free[block_id] = 0
        self.refcounts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> int:
        """Add a holder to a held or parked block; returns the new count."""
        if self._is_free[block_id]:
            raise ValueError(f"{self.name} block {block_id} is free and cannot be referenced")
        count = self.refcounts[block_id] + 1
        self.refcounts[block_id] = count
        return count

    def decref(self, block_id: int) -> int:
        """Drop a holder; returns the new count (0: the caller releases or parks it)."""
        count = self.refcounts[block_id]
        if count <= 0:
            raise ValueError(f"{self.name} block {block_id} has no reference to drop")
        self.refcounts[block_id] = count - 1
        return count - 1

    def release(self, block_id: int) -> None:
        """Put an unreferenced block back on the free list (it is reused first)."""
        if self._is_free[block_id]:
            raise ValueError(f"{self.name} block {block_id} is already free")
        if self.refcounts[block_id]:
            raise ValueError(
                f"{self.name} block {block_id} still has {self.refcounts[block_id]} reference(s)"
            )
        self._is_free[block_id] = 1
        self._free.append(block_id)
