"""Walking a sequence's blocks against the prefix index: match and insert.

Both walks hash block by block from the root (or the sequence's last indexed
node), so a prompt costs one hash and one dict lookup per block.
"""

from __future__ import annotations

from .hashing import BlockHasher
from .namespace import Namespace
from .prefix_index import HOST, PrefixNode
from .sequence import Sequence
from .tiers import TieredBlocks


class PrefixMatcher:
    """Finds cached prefixes and indexes newly computed blocks."""

    def __init__(self, tiers: TieredBlocks, block_size: int) -> None:
        self.tiers = tiers
        self.block_size = block_size
        self._hasher = BlockHasher(block_size)
        self.hash_block = self._hasher.hash_block

    def match(self, tokens: list[int], namespace: Namespace) -> list[PrefixNode]:
        """Verified nodes of the longest cached prefix within ``tokens[:-1]``.

        The last token is left out: its block must be computed to get logits.
        Changes nothing (not even LRU ticks).
        """
        index = self.tiers.index
        hash_block = self._hasher.hash_block
        bs = self.block_size
        node = index.root
        matched = []
        for i in range((len(tokens) - 1) // bs):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            ns_key = namespace.key(i, bs)
            hash_ = hash_block(node.hash, block_tokens, ns_key)
            child = index.lookup(node, hash_, block_tokens, ns_key)
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
        bs = self.block_size
        tokens = seq.token_ids
        blocks = seq.table.block_ids
        parent = seq.last_node
        for i in range(seq.num_indexed, num_full):
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            ns_key = seq.namespace.key(i, bs)
            hash_ = self._hasher.hash_block(parent.hash, block_tokens, ns_key)
            own = blocks[i]
            node = index.lookup(parent, hash_, block_tokens, ns_key)
            if node is None:
                if index.is_occupied(hash_):
                    seq.index_stopped = True
                    return
                node = tiers.index_new(parent, hash_, block_tokens, ns_key, own)
                node.owner = seq.owner
            elif node.location == HOST:
                tiers.rehome(node, own)
            elif node.block_id != own:
                tiers.pin(node)
                seq.pinned.append(node)
            node.last_access = index.tick
            parent = node
            seq.num_indexed = i + 1
            seq.last_node = node
