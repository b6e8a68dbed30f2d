"""Cache namespaces: which hash domain each block of a sequence lives in.

A cache hit is measurably faster than a miss, so sharing KV across tenants
leaks whether another tenant sent the same text. Blocks are therefore
private by default: their hash includes the tenant's secret salt. Only a
block lying *wholly* inside a registered shared system prompt hashes in the
public namespace::

    tokens  |<---- shared_prefix_len ---->|<--- private --->
    blocks  [ pub ][ pub ][ pub ][ private ][ private ] ...
                               ^ straddles the end: private

so every tenant using that prompt shares its full blocks and nothing after.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

# Distinct leading bytes keep the public domain apart from every salt,
# including an empty one.
PUBLIC_KEY = b"\x00"
_PRIVATE_TAG = b"\x01"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Where a sequence's blocks are shared.

    tenant_salt: the tenant's secret; hashed into every private block.
    shared_prefix_len: leading tokens that form a shared system prompt.
    label: for statistics only (e.g. the tenant id); never part of a hash.
    """

    tenant_salt: bytes
    shared_prefix_len: int = 0
    label: str = ""
    _private_key: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tenant_salt, bytes):
            raise TypeError(f"tenant_salt must be bytes, got {type(self.tenant_salt).__name__}")
        if not isinstance(self.shared_prefix_len, int) or self.shared_prefix_len < 0:
            raise ValueError(
                f"shared_prefix_len must be a non-negative int, got {self.shared_prefix_len!r}"
            )
        if not isinstance(self.label, str):
            raise TypeError(f"label must be str, got {type(self.label).__name__}")
        object.__setattr__(self, "_private_key", _PRIVATE_TAG + self.tenant_salt)

    @property
    def private_key(self) -> bytes:
        return self._private_key

    def is_public(self, block_index: int, block_size: int) -> bool:
        return (block_index + 1) * block_size <= self.shared_prefix_len

    def key(self, block_index: int, block_size: int) -> bytes:
        """The namespace bytes hashed into block ``block_index``."""
        if (block_index + 1) * block_size <= self.shared_prefix_len:
            return PUBLIC_KEY
        return self._private_key

    def stats_label(self, block_index: int, block_size: int) -> str:
        """Statistics label of a hit on this block: "public" or the tenant label."""
        return "public" if self.is_public(block_index, block_size) else self.label


# Every block public: for single-tenant deployments and tools where isolation
# is meaningless. Multi-tenant callers must build their own Namespace.
PUBLIC = Namespace(tenant_salt=b"", shared_prefix_len=sys.maxsize, label="public")
