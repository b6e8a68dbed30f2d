"""A sequence's block table: logical block i -> physical device block id.

The table holds block ids only. How many tokens the sequence has (its write
offset) lives in the sequence, so a fork can copy the table without caring
about offsets. Invariant kept by the manager: ``len(table) ==
ceil(num_tokens / block_size)``.
"""

from __future__ import annotations


class BlockTable:
    """Grow-only list of physical block ids, with in-place replacement for copy-on-write."""

    __slots__ = ("block_ids",)

    def __init__(self, block_ids: list[int] | None = None) -> None:
        self.block_ids: list[int] = [] if block_ids is None else block_ids

    def __len__(self) -> int:
        return len(self.block_ids)

    def __getitem__(self, index: int) -> int:
        return self.block_ids[index]

    def append(self, block_id: int) -> None:
        self.block_ids.append(block_id)

    def replace(self, index: int, block_id: int) -> int:
        """Point logical block ``index`` at ``block_id``; returns the old id."""
        old = self.block_ids[index]
        self.block_ids[index] = block_id
        return old

    def copy(self) -> BlockTable:
        return BlockTable(list(self.block_ids))

    def slot(self, position: int, block_size: int) -> int:
        """The KV slot of token ``position``: ``block_id * block_size + offset``."""
        return self.block_ids[position // block_size] * block_size + position % block_size
