"""TieredBlocks: the memory tiers (device and host) under one prefix index.

Every device block is in exactly one state:

    free        on the device free list
    referenced  refcount > 0: held by block tables (refcount = number of tables)
    cached      refcount 0, indexed: kept for reuse until room is needed

    referenced + free + cached == num_blocks

A cached node is *evictable* unless a sequence pins it (see PrefixNode.pins).
Every node a sequence references or pins has all its ancestors referenced or
pinned, so all ``num_evictable`` blocks can be reclaimed leaf by leaf; the
admission check ``free + evictable`` is therefore exact.

Evicting a device leaf moves its data to the host tier (a swap-out in the
plan, the node stays indexed with location "host") or, without a host tier,
drops the node. A full host tier first drops its least recently used leaf.
With a disk tier (``disk``), a dropped node that is not on disk yet is
written there (a ``BlockStore`` the plan runs before anything reuses the
block), so a block moves down a tier instead of being lost. A node leaving
memory hands its ``owners`` to its disk copy (``_unindex``), so which sessions
use a block is known in whichever tier holds it.
"""

from __future__ import annotations

from .block_pool import BlockPool
from .errors import CacheIntegrityError, OutOfBlocksError
from .namespace import PUBLIC_KEY
from .plan import BlockStore, PlanBuilder
from .prefix_index import DEVICE, HOST, PrefixIndex, PrefixNode
from .stats import CacheStats


class TieredBlocks:
    """Owns both pools, the prefix index and the node <-> block maps."""

    def __init__(self, num_blocks: int, num_host_blocks: int, stats: CacheStats) -> None:
        self.device = BlockPool(num_blocks, "device")
        self.host = BlockPool(num_host_blocks, "host")
        self.index = PrefixIndex()
        self.stats = stats
        # The index node whose data sits in each block (None: not indexed).
        self.node_of_block: list[PrefixNode | None] = [None] * num_blocks
        self.node_of_host_block: list[PrefixNode | None] = [None] * num_host_blocks
        self.num_evictable = 0
        self.disk = None  # cache.disk_index.DiskIndex when there is a disk tier
        # Write-through: nodes indexed since the engine last took them (to store).
        self.new_nodes: list[PrefixNode] | None = None

    @property
    def num_available(self) -> int:
        """Device blocks that can be handed out now: free plus evictable."""
        return self.device.num_free + self.num_evictable

    @property
    def num_cached(self) -> int:
        """Unreferenced indexed device blocks (evictable or pinned)."""
        return self.device.num_blocks - self.device.num_free - self._num_referenced()

    def _num_referenced(self) -> int:
        return sum(1 for count in self.device.refcounts if count)

    def usage(self) -> dict:
        """Occupancy of both tiers and the index size, JSON-able (for stats snapshots)."""
        device, host = self.device, self.host
        num_referenced = self._num_referenced()
        return {
            "device": {
                "total": device.num_blocks,
                "free": device.num_free,
                "used": num_referenced,
                "cached": device.num_blocks - device.num_free - num_referenced,
                "evictable": self.num_evictable,
            },
            "host": {
                "total": host.num_blocks,
                "free": host.num_free,
                "used": host.num_blocks - host.num_free,
            },
            "indexed_blocks": len(self.index),
        }

    # -- references ---------------------------------------------------------------

    def ref_node(self, node: PrefixNode) -> None:
        """A table takes a reference on a device node's block (reviving it if cached)."""
        block = node.block_id
        if self.device.refcounts[block] == 0 and node.pins == 0:
            self.num_evictable -= 1
        self.device.incref(block)

    def unref_block(self, block: int) -> None:
        """A table drops a block: released when unindexed, else cached."""
        if self.device.decref(block):
            return
        node = self.node_of_block[block]
        if node is None:
            self.device.release(block)
            return
        node.last_access = self.index.tick
        if node.pins == 0:
            self.num_evictable += 1
            if node.num_device_children == 0:
                self.index.push_device_candidate(node)

    def unref_blocks(self, blocks: list[int]) -> None:
        """``unref_block`` for a whole table (the hot path of ``free``)."""
        refcounts = self.device.refcounts
        node_of_block = self.node_of_block
        tick = self.index.tick
        for block in blocks:
            count = refcounts[block]
            if count > 1:
                refcounts[block] = count - 1
                continue
            node = node_of_block[block]
            if node is None or node.pins:
                self.unref_block(block)
                continue
            refcounts[block] = 0
            node.last_access = tick
            self.num_evictable += 1
            # A node with device children becomes a candidate only when its last
            # device child leaves, and that eviction pushes it then.
            if node.num_device_children == 0:
                self.index.push_device_candidate(node)

    def pin(self, node: PrefixNode) -> None:
        if node.pins == 0 and self.device.refcounts[node.block_id] == 0:
            self.num_evictable -= 1
        node.pins += 1

    def unpin(self, node: PrefixNode) -> None:
        node.pins -= 1
        if node.pins == 0 and node.location == DEVICE and self.device.refcounts[node.block_id] == 0:
            self.num_evictable += 1
            self.index.push_device_candidate(node)

    # -- indexing -----------------------------------------------------------------

    def index_new(self, parent, hash_, token_ids, ns_key, block) -> PrefixNode:
        """Index a referenced device block that now holds computed KV."""
        node = self.index.insert(parent, hash_, token_ids, ns_key, block)
        self.node_of_block[block] = node
        self.stats.blocks_indexed += 1
        if self.new_nodes is not None:
            self.new_nodes.append(node)
        return node

    def rehome(self, node: PrefixNode, block: int) -> None:
        """A host node adopts a referenced device block with identical KV (no copy)."""
        host_block = node.block_id
        self.node_of_host_block[host_block] = None
        self.host.decref(host_block)
        self.host.release(host_block)
        self.index.move_to_device(node, block)
        self.node_of_block[block] = node

    def swap_in(self, node: PrefixNode, plan: PlanBuilder, released_host: list[int]) -> int:
        """Bring a host node back to a fresh device block (held by the caller).

        The host block is only returned to the host pool by the caller after the
        whole call: a swap-out later in the same plan would otherwise overwrite
        it before this swap-in reads it.
        """
        block = self.take_block(plan)
        host_block = node.block_id
        plan.swap_in.append((host_block, block))
        self.node_of_host_block[host_block] = None
        released_host.append(host_block)
        self.index.move_to_device(node, block)
        self.node_of_block[block] = node
        self.stats.swapped_in_blocks += 1
        return block

    def release_host_blocks(self, host_blocks: list[int]) -> None:
        for host_block in host_blocks:
            self.host.decref(host_block)
            self.host.release(host_block)

    # -- allocation and eviction --------------------------------------------------

    def take_block(self, plan: PlanBuilder) -> int:
        """One device block with refcount 1, evicting the LRU cached leaf if none is free."""
        if self.device.num_free:
            return self.device.allocate()
        if not self.num_evictable:
            raise OutOfBlocksError(1, 0, "device pool")
        self._evict_one(plan)
        return self.device.allocate()

    def _evict_one(self, plan: PlanBuilder) -> None:
        victim = self.index.pop_device_victim(self.device.refcounts)
        if victim is None:
            raise CacheIntegrityError(
                f"{self.num_evictable} block(s) counted evictable but no evictable leaf exists"
            )
        block = victim.block_id
        parent = victim.parent
        host_block = self._take_host_block(plan) if self.host.num_blocks else None
        if host_block is None:
            self.plan_store(plan, victim)
            self._drop_subtree(victim, plan)
            self.stats.evictions_dropped += 1
        else:
            plan.swap_out.append((block, host_block))
            self.index.move_to_host(victim, host_block)
            self.node_of_host_block[host_block] = victim
            if not victim.children:
                self.index.push_host_candidate(victim)
            self.stats.evictions_to_host += 1
            self.stats.swapped_out_blocks += 1
        self.node_of_block[block] = None
        self.num_evictable -= 1
        self.device.release(block)
        if parent is not self.index.root and parent.num_device_children == 0:
            self.index.push_device_candidate(parent)

    def _take_host_block(self, plan: PlanBuilder) -> int | None:
        if not self.host.num_free:
            victim = self.index.pop_host_victim()
            if victim is None:
                return None
            self.plan_store(plan, victim)
            host_block = victim.block_id
            self._drop_host_node(victim)
            # A victim this very plan moved to the host holds nothing there yet: its
            # swap-out would only copy into the block handed out next, a second time.
            plan.swap_out[:] = [pair for pair in plan.swap_out if pair[1] != host_block]
            self.stats.evictions_dropped += 1
        return self.host.allocate()

    def plan_store(self, plan: PlanBuilder, node: PrefixNode) -> None:
        """Have the plan copy a node's block to the disk tier unless it is there already."""
        disk = self.disk
        if disk is None or disk.is_stored_or_writing(node.hash):
            return
        location, block = node.location, node.block_id
        if location == HOST:
            # Stores run before the plan's swaps: a host block filled by a swap-out
            # of this same plan still holds older data then, while the device block
            # it comes from still holds this node's.
            for device_block, host_block in reversed(plan.swap_out):
                if host_block == block:
                    location, block = DEVICE, device_block
                    break
        plan.stores.append(
            BlockStore(
                location,
                block,
                node.hash,
                node.parent.hash,
                node.token_ids,
                node.ns_key == PUBLIC_KEY,
                node.owner,
                frozenset(node.owners),
            )
        )

    def _unindex(self, node: PrefixNode) -> None:
        self.index.remove(node)
        if self.disk is not None and node.owners:
            self.disk.add_owners(node.hash, node.owners)

    def drop_cached_node(self, node: PrefixNode) -> None:
        """Remove a cached device leaf nobody references or pins; its block is freed."""
        parent = node.parent
        block = node.block_id
        self._unindex(node)
        self.node_of_block[block] = None
        self.num_evictable -= 1
        self.device.release(block)
        if parent is not self.index.root and parent.location == DEVICE:
            if parent.num_device_children == 0:
                self.index.push_device_candidate(parent)

    def drop_host_node(self, node: PrefixNode) -> None:
        """Remove a host leaf; its host block is freed."""
        self._drop_host_node(node)

    def _drop_host_node(self, node: PrefixNode) -> None:
        parent = node.parent
        host_block = node.block_id
        self._unindex(node)
        self.node_of_host_block[host_block] = None
        self.host.decref(host_block)
        self.host.release(host_block)
        if parent.location == HOST and not parent.children:
            self.index.push_host_candidate(parent)

    def _drop_subtree(self, victim: PrefixNode, plan: PlanBuilder) -> None:
        # Only reached when no host block can be had: the victim's host
        # descendants are useless without it, so they go too (deepest first).
        order = [victim]
        for node in order:
            order.extend(node.children.values())
        for node in reversed(order):
            if node is victim:
                self._unindex(node)
            else:
                self.plan_store(plan, node)
                self._drop_host_node(node)
