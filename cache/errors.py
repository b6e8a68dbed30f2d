"""Exceptions raised by the KV-cache manager.

Every one of them is raised *before* any state is touched, so a caller that
catches it can carry on with the cache exactly as it was.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base class of every error raised by ``cache``."""


class OutOfBlocksError(CacheError):
    """Not enough free or evictable device blocks for the request."""

    def __init__(self, needed: int, available: int, what: str = "request") -> None:
        super().__init__(
            f"{what} needs {needed} device block(s) but only {available} are free or evictable"
        )
        self.needed = needed
        self.available = available


class UnknownSequenceError(CacheError, KeyError):
    """The sequence id is not allocated (never was, or was already freed)."""

    def __init__(self, seq_id: object) -> None:
        super().__init__(f"unknown sequence {seq_id!r} (never allocated or already freed)")
        self.seq_id = seq_id

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class DuplicateSequenceError(CacheError, ValueError):
    """A sequence with this id is already allocated."""

    def __init__(self, seq_id: object) -> None:
        super().__init__(f"sequence {seq_id!r} is already allocated")
        self.seq_id = seq_id


class CacheIntegrityError(CacheError, AssertionError):
    """An invariant of the cache bookkeeping does not hold (a bug, never bad input)."""
