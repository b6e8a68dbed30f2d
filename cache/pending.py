"""Blocks being computed right now: allocated for a prefill, KV not written yet.

A prompt's full blocks past its cached prefix are registered here at
``allocate`` under the chained hash they will have once indexed. Another
request with the same prefix can then see that its blocks are on their way and
wait a step or two for a full cache hit instead of computing them again.

    prompt blocks   [ matched (indexed) | pending ............ | partial ]
                    0            pending_start      pending_start + len(pending)

An entry leaves when its owner's ``mark_computed`` passes the block (it is
indexed, or pins the identical indexed node) or when the owner is freed. A
pending block is never *matched*: it only tells the scheduler how much longer
a prefix will be once its owners' prefills advance. Several sequences may
compute the same block (admitted in one step, or after a deferral ran out), so
an entry counts its owners and lives until the last one resolves or leaves.

Invariants (checked by ``check_integrity``): each entry's owners are exactly
the live sequences listing its hash; a sequence lists only blocks at or past
``num_computed // block_size``, consecutive and chained from its last matched
or indexed block.
"""

from __future__ import annotations

from .chain import BlockChain
from .errors import CacheIntegrityError
from .sequence import Sequence


class PendingBlock:
    """One block some sequences are computing: its identity and who computes it."""

    __slots__ = ("hash", "parent_hash", "token_ids", "ns_key", "owners")

    def __init__(self, hash_: bytes, parent_hash: bytes, token_ids: tuple, ns_key: bytes):
        self.hash = hash_
        self.parent_hash = parent_hash
        self.token_ids = token_ids
        self.ns_key = ns_key
        self.owners = 0


class PendingBlocks:
    """``hash -> PendingBlock`` for every block some live prefill has not written yet."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.entries: dict[bytes, PendingBlock] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def register(self, seq: Sequence, first_block: int) -> None:
        """Register the sequence's full prompt blocks from ``first_block`` on."""
        hashes: list[bytes] = []
        chain = seq.chain
        for block in chain.blocks(first_block, chain.num_full_blocks):
            entry = self.entries.get(block.hash)
            if entry is None:
                entry = PendingBlock(block.hash, block.parent_hash, block.token_ids, block.ns_key)
                self.entries[block.hash] = entry
            elif entry.token_ids != block.token_ids or entry.parent_hash != block.parent_hash:
                break  # a hash collision: the rest of this prompt is not announced
            entry.owners += 1
            hashes.append(block.hash)
        seq.pending = hashes
        seq.pending_start = first_block

    def resolve(self, seq: Sequence, num_full: int) -> None:
        """The sequence's KV now covers ``num_full`` blocks: those stop being pending."""
        done = min(num_full - seq.pending_start, len(seq.pending))
        if done <= 0:
            return
        for hash_ in seq.pending[:done]:
            self._release(hash_)
        del seq.pending[:done]
        seq.pending_start += done

    def drop(self, seq: Sequence) -> None:
        """The sequence leaves (freed or preempted) before computing its pending blocks."""
        for hash_ in seq.pending:
            self._release(hash_)
        seq.pending = []

    def _release(self, hash_: bytes) -> None:
        entry = self.entries[hash_]
        entry.owners -= 1
        if entry.owners == 0:
            del self.entries[hash_]

    def extent(self, chain: BlockChain, first_block: int) -> int:
        """Matchable blocks of ``chain`` from ``first_block`` on that are pending, consecutively.

        Every hit is verified by its token ids, namespace key and parent, like
        an index lookup. Changes nothing.
        """
        if not self.entries:
            return 0
        count = 0
        for block in chain.blocks(first_block, chain.num_matchable_blocks):
            entry = self.entries.get(block.hash)
            if (
                entry is None
                or entry.parent_hash != block.parent_hash
                or entry.ns_key != block.ns_key
                or entry.token_ids != block.token_ids
            ):
                break
            count += 1
        return count

    def check(self, seqs: list[Sequence]) -> None:
        """Raise CacheIntegrityError unless the registry matches the live sequences."""
        owners: dict[bytes, int] = {}
        bs = self.block_size
        for seq in seqs:
            if seq.pending and seq.pending_start < seq.num_computed // bs:
                raise CacheIntegrityError(
                    f"seq {seq.seq_id!r}: block {seq.pending_start} is computed but still pending"
                )
            if seq.pending_start + len(seq.pending) > len(seq.token_ids) // bs:
                raise CacheIntegrityError(f"seq {seq.seq_id!r}: a pending block is not full")
            previous = None
            for hash_ in seq.pending:
                entry = self.entries.get(hash_)
                if entry is None:
                    raise CacheIntegrityError(f"seq {seq.seq_id!r}: pending hash not registered")
                if previous is not None and entry.parent_hash != previous:
                    raise CacheIntegrityError(f"seq {seq.seq_id!r}: pending blocks do not chain")
                previous = hash_
                owners[hash_] = owners.get(hash_, 0) + 1
        for hash_, entry in self.entries.items():
            if entry.owners != owners.get(hash_, 0) or entry.owners <= 0:
                raise CacheIntegrityError(
                    f"pending block {hash_.hex()[:8]}: {entry.owners} owner(s) counted, "
                    f"{owners.get(hash_, 0)} sequence(s) list it"
                )
