"""Walking a sequence's blocks against the prefix index: match and insert.

Both walks read the sequence's block chain (``cache.chain``) from the root or
from its last indexed node: one dict lookup per block, and each block hashed
once for the whole life of the sequence.
"""

from __future__ import annotations

from .chain import BlockChain
from .memory_tiers import TieredBlocks
from .namespace import PUBLIC_KEY
from .prefix_index import HOST, PrefixNode
from .sequence import Sequence


class PrefixMatcher:
    """Finds cached prefixes and indexes newly computed blocks."""

    def __init__(self, tiers: TieredBlocks, block_size: int) -> None:
        self.tiers = tiers
        self.block_size = block_size

    def match(self, chain: BlockChain) -> list[PrefixNode]:
        """Verified nodes of the longest cached prefix within the chain's matchable blocks.

        The last token's block is left out: it must be computed to get logits.
        Changes nothing (not even LRU ticks).
        """
        index = self.tiers.index
        node = index.root
        matched = []
        for block in chain.blocks(0, chain.num_matchable_blocks):
            child = index.lookup(node, block.hash, block.token_ids, block.ns_key)
            if child is None:
                break
            matched.append(child)
            node = child
        return matched

    def index_computed(self, seq: Sequence, num_full: int) -> None:
        """Index the sequence's blocks ``[seq.num_indexed, num_full)``.

        Per block, one of:
          new hash          the sequence's block becomes a node
          node on host      the node adopts the sequence's block (same KV, no copy)
          node elsewhere    identical KV already on the device: the sequence pins
                            it and keeps its own copy private
          hash collision    indexing stops; the rest of the sequence stays private
        """
        tiers = self.tiers
        index = tiers.index
        blocks = seq.table.block_ids
        parent = seq.last_node
        for block in seq.chain.blocks(seq.num_indexed, num_full):
            i = block.index
            own = blocks[i]
            node = index.lookup(parent, block.hash, block.token_ids, block.ns_key)
            if node is None:
                if index.is_occupied(block.hash):
                    seq.index_stopped = True
                    return
                node = tiers.index_new(parent, block.hash, block.token_ids, block.ns_key, own)
                node.owner = seq.owner
            elif node.location == HOST:
                tiers.rehome(node, own)
            elif node.block_id != own:
                tiers.pin(node)
                seq.pinned.append(node)
            if seq.owner and node.ns_key != PUBLIC_KEY:
                node.owners.add(seq.owner)
            node.last_access = index.tick
            parent = node
            seq.num_indexed = i + 1
            seq.last_node = node
