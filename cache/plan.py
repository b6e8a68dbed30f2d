"""Results the manager hands to the engine.

A CachePlan lists the block copies the engine must run before the next
forward pass, in this order: ``stores`` (blocks leaving memory for the disk
tier, copied out before anything can overwrite them), ``swap_out``, then
``swap_in``, then ``copies``.
A block freed by one phase may be the destination of a later phase of the
same plan, so the order matters. Plans from several calls must be executed
call by call, each one whole, in the order the calls were made.
"""

from __future__ import annotations

from typing import NamedTuple


class BlockStore(NamedTuple):
    """One block whose KV goes to the disk tier: where it is now and what it holds.

    location: "device" or "host" (the tier ``block_id`` belongs to).
    shared: the block lies wholly inside a shared system prompt.
    owner: digest of the session that computed it (b"" when none).
    owners: the sessions that used it while in memory (``PrefixNode.owners``).
    """

    location: str
    block_id: int
    hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    shared: bool
    owner: bytes
    owners: frozenset[bytes] = frozenset()


class CachePlan(NamedTuple):
    """Block copies for the engine; each pair is (src, dst)."""

    swap_out: tuple[tuple[int, int], ...] = ()  # (device_block, host_block)
    swap_in: tuple[tuple[int, int], ...] = ()  # (host_block, device_block)
    copies: tuple[tuple[int, int], ...] = ()  # (src_device_block, dst_device_block)
    stores: tuple[BlockStore, ...] = ()  # run first: the blocks may be reused below

    @property
    def is_empty(self) -> bool:
        return not (self.swap_out or self.swap_in or self.copies or self.stores)


EMPTY_PLAN = CachePlan()


class PlanBuilder:
    """Mutable lists while a call runs; ``build`` freezes them."""

    __slots__ = ("swap_out", "swap_in", "copies", "stores")

    def __init__(self) -> None:
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.copies: list[tuple[int, int]] = []
        self.stores: list[BlockStore] = []

    def build(self) -> CachePlan:
        if not (self.swap_out or self.swap_in or self.copies or self.stores):
            return EMPTY_PLAN
        return CachePlan(
            tuple(self.swap_out), tuple(self.swap_in), tuple(self.copies), tuple(self.stores)
        )


class DiskLoad(NamedTuple):
    """One block of a prompt to read from the disk tier into ``device_block``.

    The file is verified against every field before its KV is used: the chained
    ``hash`` of (``parent_hash``, ``token_ids``, ``ns_key``) must match.
    """

    block_index: int
    device_block: int
    hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    ns_key: bytes


class AllocResult(NamedTuple):
    """Outcome of ``KVCacheManager.allocate``.

    num_cached_tokens: leading prompt tokens whose KV is already in the cache
        (a multiple of block_size); the engine computes the rest.
    loads: blocks right after those that the disk tier holds. They are
        allocated like the rest of the prompt; once the engine has read and
        verified them, ``complete_load`` counts them as computed.
    num_host_tokens: how many of ``num_cached_tokens`` came from the host tier.
    """

    num_cached_tokens: int
    plan: CachePlan
    loads: tuple[DiskLoad, ...] = ()
    num_host_tokens: int = 0


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
    num_disk_tokens: tokens right after the cached prefix that the disk tier
        holds (``allocate`` hands them out as ``loads``).
    """

    num_cached_tokens: int
    num_pending_tokens: int
    num_blocks_needed: int
    num_disk_tokens: int = 0
