"""Radix-style prefix index over full, computed blocks.

A node stands for one full block; its children are the blocks that followed it
in some sequence. ``nodes`` maps a chained hash to its node, so matching a
prompt is one dict lookup per block. On every hit the stored token ids, the
namespace key and the parent are compared too: a hash collision can never
hand out another prompt's (or tenant's) KV.

Where a node's data lives:

    location "device": block_id is a device block (held by tables or cached)
    location "host":   block_id is a host-tier block (the node holds it)

Invariant: a device node's parent is a device node or the root, so a prefix
walk meets its device blocks first, then (maybe) host blocks.

Eviction candidates are found through two heaps keyed by ``last_access`` with
lazy invalidation: an entry is valid only if the node is still a candidate
and was not touched since the push. Whoever makes a node a candidate pushes
it, so popping the oldest valid entry yields the least recently used leaf.

A node's ``last_access`` is the last activity of the sequences (sessions)
using it: every match and every free stamps the whole chain. Blocks wholly
inside a shared system prompt (public namespace) go last: the heaps order by
(class, last_access), so a public leaf is evicted only when no private
candidate is left.
"""

from __future__ import annotations

import heapq
import itertools

from .hashing import ROOT_HASH
from .namespace import PUBLIC_KEY

DEVICE = "device"
HOST = "host"


class PrefixNode:
    """One indexed block.

    pins: sequences that chain through this node without holding its block
        (they hold an identical private copy); a pinned node is never evicted,
        which keeps the chain under their own indexed blocks intact.
    num_device_children: children with location "device"; a device node is a
        leaf for eviction when this is 0.
    num_hits: how many times a prompt reused this block.
    owner: digest of the session whose request computed the block (b"": none);
        it names the block's file and finds a session's unstored turns.
    owners: digests of the sessions whose sequences computed or matched the block
        since it entered memory (never b""). Invariant: it holds the owner of every
        live sequence whose indexed chain runs through the node. Forgetting a
        session takes it out of the set; a block goes only once no one else is in it.
    """

    __slots__ = (
        "hash",
        "parent",
        "children",
        "token_ids",
        "ns_key",
        "block_id",
        "location",
        "last_access",
        "pins",
        "num_device_children",
        "num_hits",
        "owner",
        "owners",
    )

    def __init__(self, hash_, parent, token_ids, ns_key, block_id, location, tick) -> None:
        self.hash = hash_
        self.parent = parent
        self.children: dict[bytes, PrefixNode] = {}
        self.token_ids = token_ids
        self.ns_key = ns_key
        self.block_id = block_id
        self.location = location
        self.last_access = tick
        self.pins = 0
        self.num_device_children = 0
        self.num_hits = 0
        self.owner = b""
        self.owners: set[bytes] = set()

    def __repr__(self) -> str:
        return (
            f"PrefixNode({self.hash.hex()[:8]}, {self.location}:{self.block_id}, "
            f"pins={self.pins}, children={len(self.children)})"
        )


class PrefixIndex:
    """The tree, the hash dict and the LRU candidate heaps.

    The index does not own blocks: the manager allocates and releases them and
    tells the index where a node's data lives.
    """

    def __init__(self) -> None:
        self.root = PrefixNode(ROOT_HASH, None, (), b"", -1, DEVICE, 0)
        self.nodes: dict[bytes, PrefixNode] = {}
        self.tick = 0
        self._device_heap: list[tuple[int, int, int, PrefixNode]] = []
        self._host_heap: list[tuple[int, int, int, PrefixNode]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.nodes)

    def advance(self) -> int:
        """Start a new LRU epoch (one per manager operation)."""
        self.tick += 1
        return self.tick

    def lookup(self, parent: PrefixNode, hash_: bytes, token_ids, ns_key: bytes):
        """The verified child of ``parent`` for this block, or None.

        A node whose hash matches but whose tokens, namespace or parent do not
        is a collision and is treated as a miss.
        """
        node = self.nodes.get(hash_)
        if node is None:
            return None
        if node.parent is not parent or node.ns_key != ns_key or node.token_ids != token_ids:
            return None
        return node

    def is_occupied(self, hash_: bytes) -> bool:
        return hash_ in self.nodes

    def insert(self, parent: PrefixNode, hash_: bytes, token_ids: tuple, ns_key: bytes, block_id):
        """Add a device-resident node for a freshly computed block under ``parent``."""
        if hash_ in self.nodes:
            raise ValueError("hash already indexed; look it up first")
        if parent.location != DEVICE:
            raise ValueError("a device node's parent must be device-resident")
        node = PrefixNode(hash_, parent, token_ids, ns_key, block_id, DEVICE, self.tick)
        self.nodes[hash_] = node
        parent.children[hash_] = node
        parent.num_device_children += 1
        return node

    def remove(self, node: PrefixNode) -> None:
        """Drop a childless node from the tree."""
        if node.children:
            raise ValueError("only a node without children can be removed")
        del self.nodes[node.hash]
        parent = node.parent
        del parent.children[node.hash]
        if node.location == DEVICE:
            parent.num_device_children -= 1
        node.parent = None

    def move_to_host(self, node: PrefixNode, host_block: int) -> None:
        node.location = HOST
        node.block_id = host_block
        node.parent.num_device_children -= 1

    def move_to_device(self, node: PrefixNode, device_block: int) -> None:
        if node.parent.location != DEVICE:
            raise ValueError("cannot bring a node to the device before its parent")
        node.location = DEVICE
        node.block_id = device_block
        node.parent.num_device_children += 1

    def push_device_candidate(self, node: PrefixNode) -> None:
        entry = (node.ns_key == PUBLIC_KEY, node.last_access, next(self._seq), node)
        heapq.heappush(self._device_heap, entry)
        if len(self._device_heap) > 4 * len(self.nodes) + 64:
            self._device_heap = self._compact(self._device_heap, DEVICE)

    def push_host_candidate(self, node: PrefixNode) -> None:
        entry = (node.ns_key == PUBLIC_KEY, node.last_access, next(self._seq), node)
        heapq.heappush(self._host_heap, entry)
        if len(self._host_heap) > 4 * len(self.nodes) + 64:
            self._host_heap = self._compact(self._host_heap, HOST)

    def pop_device_victim(self, refcounts: list[int]):
        """The least recently used unreferenced, unpinned device leaf, or None."""
        heap = self._device_heap
        while heap:
            _, tick, _, node = heapq.heappop(heap)
            if (
                node.last_access == tick
                and node.parent is not None
                and node.location == DEVICE
                and node.num_device_children == 0
                and node.pins == 0
                and refcounts[node.block_id] == 0
            ):
                return node
        return None

    def pop_host_victim(self):
        """The least recently used host node with no children at all, or None."""
        heap = self._host_heap
        while heap:
            _, tick, _, node = heapq.heappop(heap)
            if (
                node.last_access == tick
                and node.parent is not None
                and node.location == HOST
                and not node.children
                and node.pins == 0
            ):
                return node
        return None

    def _compact(self, heap, location):
        # Stale entries only cost memory; drop them once they outnumber nodes.
        kept = [
            entry
            for entry in heap
            if entry[3].parent is not None
            and entry[3].location == location
            and entry[3].last_access == entry[1]
        ]
        heapq.heapify(kept)
        return kept

    def walk(self):
        """Every node reachable from the root (depth first), for integrity checks."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
