"""Chained block hashes for the prefix index.

    h_i = xxh3_128(h_{i-1} || token bytes of block i || namespace bytes of block i)

with h_{-1} = ROOT_HASH. Chaining makes a block's hash name its whole prefix,
so one dict lookup per block finds a match. Token ids are packed as
little-endian uint32, which also rejects ids outside [0, 2**32).
"""

from __future__ import annotations

import struct

import xxhash

ROOT_HASH = bytes(16)

# Looked up at call time (not bound as a default) so tests can force collisions.
_digest = xxhash.xxh3_128_digest


class BlockHasher:
    """Hashes full blocks of ``block_size`` tokens."""

    __slots__ = ("block_size", "_pack")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pack = struct.Struct(f"<{block_size}I").pack

    def hash_block(self, parent_hash: bytes, token_ids, namespace_key: bytes) -> bytes:
        """Hash of one full block given its parent's hash; ``token_ids`` has block_size ids."""
        try:
            packed = self._pack(*token_ids)
        except struct.error as exc:
            raise ValueError(
                f"a block needs exactly {self.block_size} token ids in [0, 2**32): {exc}"
            ) from None
        return _digest(parent_hash + packed + namespace_key)
