"""The invariant checker behind ``KVCacheManager.check_integrity``.

O(blocks + nodes + table entries): meant for tests and the debug mode, which
runs it after every mutating call.
"""

from __future__ import annotations

from collections import Counter

from .errors import CacheIntegrityError
from .namespace import PUBLIC_KEY
from .prefix_index import DEVICE, HOST


def _fail(message: str) -> None:
    raise CacheIntegrityError(message)


def check_integrity(tiers, seqs, block_size: int) -> None:
    """Raise CacheIntegrityError naming the first broken invariant."""
    seqs = list(seqs)
    device = tiers.device
    holders: Counter[int] = Counter()
    pins: Counter[int] = Counter()
    for seq in seqs:
        blocks = seq.table.block_ids
        expected = -(-len(seq.token_ids) // block_size)
        if len(blocks) != expected:
            _fail(f"seq {seq.seq_id!r}: {len(blocks)} blocks for {len(seq.token_ids)} tokens")
        if not 0 <= seq.num_computed <= len(seq.token_ids):
            _fail(f"seq {seq.seq_id!r}: num_computed {seq.num_computed} out of range")
        if seq.num_indexed > seq.num_computed // block_size:
            _fail(f"seq {seq.seq_id!r}: {seq.num_indexed} blocks indexed beyond computed KV")
        if len(set(blocks)) != len(blocks):
            _fail(f"seq {seq.seq_id!r}: a block appears twice in its table {blocks}")
        holders.update(blocks)
        for node in seq.pinned:
            pins[id(node)] += 1
        last = seq.last_node
        node = last
        while seq.owner and node is not tiers.index.root and node.parent is not None:
            if node.ns_key != PUBLIC_KEY and seq.owner not in node.owners:
                _fail(f"seq {seq.seq_id!r}: its owner is not among the owners of {node!r}")
            node = node.parent
        if last is not tiers.index.root and (
            tiers.index.nodes.get(last.hash) is not last or last.location != DEVICE
        ):
            _fail(f"seq {seq.seq_id!r}: its last indexed node left the device index")

    _check_device_blocks(tiers, holders)
    _check_index(tiers, pins, block_size)
    _check_host(tiers)
    if not seqs and (any(device.refcounts) or any(pins.values())):
        _fail("no sequence is alive but blocks are still referenced or pinned")


def _check_device_blocks(tiers, holders: Counter) -> None:
    device = tiers.device
    free_ids = device.free_block_ids()
    if len(set(free_ids)) != len(free_ids):
        _fail("a device block is on the free list twice")
    free_set = set(free_ids)
    num_referenced = num_cached = 0
    for block in range(device.num_blocks):
        count = device.refcounts[block]
        is_free = device.is_free(block)
        node = tiers.node_of_block[block]
        if is_free != (block in free_set):
            _fail(f"device block {block}: free flag disagrees with the free list")
        if count != holders.get(block, 0):
            _fail(f"device block {block}: refcount {count} but {holders.get(block, 0)} table(s)")
        if is_free:
            if count or node is not None:
                _fail(f"device block {block} is free but referenced or indexed")
        elif count:
            num_referenced += 1
        elif node is None:
            _fail(f"device block {block} is unreferenced, unindexed and not free (leaked)")
        else:
            num_cached += 1
        if node is not None and (node.location != DEVICE or node.block_id != block):
            _fail(f"device block {block} maps to a node that does not hold it")
    if num_referenced + len(free_ids) + num_cached != device.num_blocks:
        _fail(
            f"referenced {num_referenced} + free {len(free_ids)} + cached {num_cached} "
            f"!= {device.num_blocks}"
        )


def _check_index(tiers, pins: Counter, block_size: int) -> None:
    index = tiers.index
    refcounts = tiers.device.refcounts
    reached = 0
    num_evictable = 0
    for node in index.walk():
        reached += 1
        if index.nodes.get(node.hash) is not node:
            _fail(f"{node!r} is in the tree but not in the hash dict")
        parent = node.parent
        if parent is None or parent.children.get(node.hash) is not node:
            _fail(f"{node!r} is not its parent's child")
        if b"" in node.owners:
            _fail(f"{node!r}: the empty owner is among its owners")
        if len(node.token_ids) != block_size:
            _fail(f"{node!r} holds {len(node.token_ids)} token ids")
        if node.pins != pins.get(id(node), 0):
            _fail(f"{node!r}: pins {node.pins} but {pins.get(id(node), 0)} sequence(s) pin it")
        device_children = sum(1 for c in node.children.values() if c.location == DEVICE)
        if node.num_device_children != device_children:
            _fail(f"{node!r}: num_device_children is {node.num_device_children}")
        if node.location == DEVICE:
            if parent is not index.root and parent.location != DEVICE:
                _fail(f"{node!r} is on the device but its parent is on the host")
            if tiers.node_of_block[node.block_id] is not node:
                _fail(f"{node!r}: device block {node.block_id} does not map back to it")
            if refcounts[node.block_id] == 0 and node.pins == 0:
                num_evictable += 1
        elif node.location == HOST:
            if node.pins:
                _fail(f"{node!r}: a host node is pinned")
            if tiers.node_of_host_block[node.block_id] is not node:
                _fail(f"{node!r}: host block {node.block_id} does not map back to it")
        else:
            _fail(f"{node!r}: unknown location {node.location!r}")
    if reached != len(index.nodes):
        _fail(f"hash dict holds {len(index.nodes)} nodes but {reached} are in the tree")
    if index.root.num_device_children != sum(
        1 for c in index.root.children.values() if c.location == DEVICE
    ):
        _fail("root's num_device_children is wrong")
    if num_evictable != tiers.num_evictable:
        _fail(f"num_evictable is {tiers.num_evictable} but {num_evictable} nodes are evictable")


def _check_host(tiers) -> None:
    host = tiers.host
    free_ids = set(host.free_block_ids())
    for block in range(host.num_blocks):
        node = tiers.node_of_host_block[block]
        if node is None:
            if block not in free_ids or host.refcounts[block]:
                _fail(f"host block {block} is neither free nor held by a host node")
        else:
            if block in free_ids or host.refcounts[block] != 1:
                _fail(f"host block {block} is held by {node!r} but free or refcount != 1")
            if node.location != HOST or node.block_id != block:
                _fail(f"host block {block} maps to a node that does not hold it")
            if tiers.index.nodes.get(node.hash) is not node:
                _fail(f"host block {block} maps to a node no longer indexed")
