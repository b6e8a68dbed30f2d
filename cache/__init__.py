"""Paged KV-cache bookkeeping in plain Python (no torch).

See docs/cache.md for the data structures, invariants and namespace rules.
"""

from .block_pool import BlockPool
from .block_table import BlockTable
from .chain import BlockChain, ChainBlock
from .errors import (
    CacheError,
    CacheIntegrityError,
    DuplicateSequenceError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from .hashing import BlockHasher
from .manager import KVCacheManager
from .namespace import PUBLIC, Namespace
from .plan import AllocResult, AppendResult, CachePlan, PrefixMatch
from .prefix_index import PrefixIndex, PrefixNode
from .stats import CacheStats

__all__ = [
    "AllocResult",
    "AppendResult",
    "BlockChain",
    "BlockHasher",
    "BlockPool",
    "BlockTable",
    "CacheError",
    "CacheIntegrityError",
    "CachePlan",
    "CacheStats",
    "ChainBlock",
    "DuplicateSequenceError",
    "KVCacheManager",
    "Namespace",
    "OutOfBlocksError",
    "PUBLIC",
    "PrefixIndex",
    "PrefixMatch",
    "PrefixNode",
    "UnknownSequenceError",
]
