"""A token list's chained block hashes, each hashed once and kept.

    blocks   [ hashed ............ | not yet hashed | partial ]
             0             len(hashes)    len(tokens) // block_size

Invariant: ``hashes[i] == hash_block(parent, tokens[i*bs:(i+1)*bs], namespace.key(i, bs))``
with ``parent = hashes[i - 1]`` (``ROOT_HASH`` for block 0). ``tokens`` only
grow (``extend``) or are cut back (``truncate``: speculative tokens rolled back), and
a cut drops the hashes of the blocks it shortens, so a hash kept stays true for the
life of the chain. Every walk over a prompt (the index match, the pending blocks, the disk
tier, indexing once computed) reads the same chain, so a sequence's blocks are
hashed once between its admission and its end, and a walk that stops early
hashes nothing past where it stopped.

Token ids are checked here, once, when they join the chain.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

from .hashing import ROOT_HASH, BlockHasher
from .namespace import Namespace

_MAX_TOKEN_ID = 2**32


def checked_tokens(token_ids: Iterable[int]) -> list[int]:
    """A new list of ``token_ids``; ValueError unless each is an int in [0, 2**32)."""
    tokens = list(token_ids)
    for token in tokens:
        if type(token) is not int or not 0 <= token < _MAX_TOKEN_ID:
            raise ValueError(f"token ids must be ints in [0, 2**32), got {token!r}")
    return tokens


class ChainBlock(NamedTuple):
    """Full block ``index`` of a chain: what the prefix index and the disk tier key on."""

    index: int
    hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    ns_key: bytes


class BlockChain:
    """The tokens of one prompt or sequence with their chained block hashes."""

    __slots__ = ("hasher", "namespace", "tokens", "hashes")

    def __init__(self, hasher: BlockHasher, token_ids: Iterable[int], namespace: Namespace):
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a cache.Namespace, got {type(namespace).__name__}")
        self.hasher = hasher
        self.namespace = namespace
        self.tokens = checked_tokens(token_ids)
        self.hashes: list[bytes] = []

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_full_blocks(self) -> int:
        return len(self.tokens) // self.hasher.block_size

    @property
    def num_matchable_blocks(self) -> int:
        """Full blocks before the last token's block: what a cache hit may cover.

        The last token's KV must be computed to get its logits.
        """
        return max(0, len(self.tokens) - 1) // self.hasher.block_size

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens (checked); the hashes so far stay valid."""
        self.tokens.extend(checked_tokens(token_ids))

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens; hashes of blocks no longer full go."""
        if type(num_tokens) is not int or not 0 <= num_tokens <= len(self.tokens):
            raise ValueError(f"num_tokens must be an int in [0, {len(self.tokens)}]")
        del self.tokens[num_tokens:]
        del self.hashes[num_tokens // self.hasher.block_size :]

    def copy(self) -> BlockChain:
        """A chain sharing nothing mutable (the hashes are immutable bytes)."""
        twin = BlockChain.__new__(BlockChain)
        twin.hasher = self.hasher
        twin.namespace = self.namespace
        twin.tokens = list(self.tokens)
        twin.hashes = list(self.hashes)
        return twin

    def parent_hash(self, index: int) -> bytes:
        """The hash block ``index`` chains from (``ROOT_HASH`` for block 0)."""
        return self.hash(index - 1) if index else ROOT_HASH

    def hash(self, index: int) -> bytes:
        """The chained hash of full block ``index``, hashing up to it if not done yet."""
        hashes = self.hashes
        if index < len(hashes):
            return hashes[index]
        if not 0 <= index < self.num_full_blocks:
            raise IndexError(f"block {index} is not a full block of {len(self.tokens)} tokens")
        bs = self.hasher.block_size
        hash_block = self.hasher.hash_block
        key = self.namespace.key
        tokens = self.tokens
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), index + 1):
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs], key(i, bs))
            hashes.append(parent)
        return parent

    def block(self, index: int) -> ChainBlock:
        bs = self.hasher.block_size
        return ChainBlock(
            index,
            self.hash(index),
            self.parent_hash(index),
            tuple(self.tokens[index * bs : (index + 1) * bs]),
            self.namespace.key(index, bs),
        )

    def blocks(self, start: int, stop: int) -> Iterator[ChainBlock]:
        """Full blocks ``[start, stop)`` in order, each hashed only when reached."""
        for index in range(start, stop):
            yield self.block(index)
