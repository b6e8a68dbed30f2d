"""Results the manager hands to the engine.

A CachePlan lists the block copies the engine must run before the next
forward pass, in this order: ``swap_out``, then ``swap_in``, then ``copies``.
A block freed by one phase may be the destination of a later phase of the
same plan, so the order matters. Plans from several calls must be executed
call by call, each one whole, in the order the calls were made.
"""

from __future__ import annotations

from typing import NamedTuple


class CachePlan(NamedTuple):
    """Block copies for the engine; each pair is (src, dst)."""

    swap_out: tuple[tuple[int, int], ...] = ()  # (device_block, host_block)
    swap_in: tuple[tuple[int, int], ...] = ()  # (host_block, device_block)
    copies: tuple[tuple[int, int], ...] = ()  # (src_device_block, dst_device_block)

    @property
    def is_empty(self) -> bool:
        return not (self.swap_out or self.swap_in or self.copies)


EMPTY_PLAN = CachePlan()


class PlanBuilder:
    """Mutable lists while a call runs; ``build`` freezes them."""

    __slots__ = ("swap_out", "swap_in", "copies")

    def __init__(self) -> None:
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.copies: list[tuple[int, int]] = []

    def build(self) -> CachePlan:
        if not (self.swap_out or self.swap_in or self.copies):
            return EMPTY_PLAN
        return CachePlan(tuple(self.swap_out), tuple(self.swap_in), tuple(self.copies))


class AllocResult(NamedTuple):
    """Outcome of ``KVCacheManager.allocate``.

    num_cached_tokens: leading prompt tokens whose KV is already in the cache
        (a multiple of block_size); the engine computes the rest.
    """

    num_cached_tokens: int
    plan: CachePlan


class AppendResult(NamedTuple):
    """Outcome of ``KVCacheManager.append_slots``: one KV slot per new token."""

    slots: list[int]
    plan: CachePlan


class PrefixMatch(NamedTuple):
    """What ``allocate`` would find for a prompt now (``KVCacheManager.match_prefix``).

    num_cached_tokens: leading prompt tokens ``allocate`` would map onto cached
        blocks (a multiple of block_size; never the last prompt token).
    num_pending_tokens: tokens right after those whose blocks other sequences
        are computing now: they become cached once those prefills pass them.
    num_blocks_needed: as ``num_blocks_needed``; exact for ``can_allocate``.
    """

    num_cached_tokens: int
    num_pending_tokens: int
    num_blocks_needed: int
