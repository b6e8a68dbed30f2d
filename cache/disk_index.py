"""The disk tier's bookkeeping: which blocks are on disk, within a byte budget.

Plain Python, owned by the engine thread like the rest of ``cache/``. The files
themselves are written, read and deleted elsewhere (``chatsvc.engine.kv_disk``);
this index only learns of a block once its file is complete (``add``), so a
match can never name a half-written block.

A block is keyed by its chained prefix hash, which already carries the tenant
namespace. The entries form a forest through their parent hashes::

    entries   hash -> DiskEntry(parent_hash, owner, owners, shared, last_access)
    children  parent hash -> hashes of on-disk children

``owner`` is the session that computed the block (it is in the file name);
``owners`` the sessions known to use it (``PrefixNode.owners``, handed down
when the block leaves memory; never b""). ``owners`` lives in memory only: a
block found at start-up has none until a session uses it again, so deleting a
session after a restart may drop a block another session had used (it
recomputes it) but never keeps one for a session that was deleted.

A block's parent need not be on disk itself (it may live only in memory, or
its write may have been dropped): a prompt walks the memory tiers first and
continues here from wherever they stopped.

Eviction within the budget is leaf-first and least recently used, in two
classes: blocks of sessions first, blocks wholly inside shared system prompts
(``shared``) only when no session block is left to evict. ``last_access`` is
wall-clock seconds, so the order survives a restart (it comes back from the
files' modification times).

Writes are reserved before they are queued (``reserve``), so ``used_bytes``
counts queued writes too and the budget is never exceeded, even briefly.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import NamedTuple

from .hashing import ROOT_HASH

SESSION, SHARED = 0, 1  # eviction classes: lower goes first


class DiskEntry:
    """One block whose file is complete on disk."""

    __slots__ = ("hash", "parent_hash", "owner", "owners", "shared", "last_access")

    def __init__(
        self,
        hash_: bytes,
        parent_hash: bytes,
        owner: bytes,
        shared: bool,
        now: float,
        owners: Iterable[bytes] = (),
    ):
        self.hash = hash_
        self.parent_hash = parent_hash
        self.owner = owner  # digest of the session that computed it (b"" for none)
        self.owners = set(owners)
        self.shared = shared
        self.last_access = now


class PendingWrite:
    """A block whose file is being written."""

    __slots__ = ("hash", "parent_hash", "owner", "owners", "shared", "doomed")

    def __init__(
        self, hash_: bytes, parent_hash: bytes, owner: bytes, shared: bool, owners=()
    ) -> None:
        self.hash = hash_
        self.parent_hash = parent_hash
        self.owner = owner
        self.owners = set(owners)
        self.shared = shared
        self.doomed = False


class Reservation(NamedTuple):
    """Outcome of ``reserve``: whether to write, and the blocks evicted (delete their files)."""

    granted: bool
    evicted: tuple[DiskEntry, ...]


class DiskIndex:
    """On-disk blocks, their forest, the byte budget and the eviction heap."""

    def __init__(self, block_nbytes: int, budget_bytes: int) -> None:
        if block_nbytes <= 0:
            raise ValueError(f"block_nbytes must be positive, got {block_nbytes}")
        self.block_nbytes = block_nbytes
        self.budget_bytes = max(0, int(budget_bytes))
        self.entries: dict[bytes, DiskEntry] = {}
        self.children: dict[bytes, set[bytes]] = {}
        # Blocks whose write is queued: not readable yet. ``doomed`` is set when
        # the block is forgotten meanwhile (its file is then deleted, never indexed).
        self.writing: dict[bytes, PendingWrite] = {}
        self.num_evicted = 0  # blocks dropped to stay within the budget
        self.num_refused = 0  # writes refused: nothing evictable of their class
        self._heap: list[tuple[int, float, int, bytes]] = []
        self._seq = itertools.count()

    # -- queries ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, hash_: bytes) -> bool:
        return hash_ in self.entries

    @property
    def used_bytes(self) -> int:
        return (len(self.entries) + len(self.writing)) * self.block_nbytes

    def is_stored_or_writing(self, hash_: bytes) -> bool:
        return hash_ in self.entries or hash_ in self.writing

    def child_hashes(self, hash_: bytes) -> set[bytes]:
        return self.children.get(hash_, set())

    def writing_children(self, hash_: bytes) -> set[bytes]:
        """Queued writes whose parent is ``hash_`` (few: the queue is bounded)."""
        return {w.hash for w in self.writing.values() if w.parent_hash == hash_}

    def describe(self, hash_: bytes) -> DiskEntry | PendingWrite | None:
        """The entry or the queued write of a block (owner, shared, parent_hash)."""
        return self.entries.get(hash_) or self.writing.get(hash_)

    def continues(self, hash_: bytes, parent_hash: bytes) -> bool:
        """Whether the block ``hash_`` is on disk under ``parent_hash``."""
        entry = self.entries.get(hash_)
        return entry is not None and entry.parent_hash == parent_hash

    def recent_chains(self, max_blocks: int) -> list[DiskEntry]:
        """At most ``max_blocks`` blocks of the most recently used chains: each chain
        from the root down to its most recent block, root first, most recent chain
        first (the blocks a restart's next turns ask for). Chains with a block
        missing on the way to the root are left out: a prompt's match reaches no
        block below the gap. Changes nothing."""
        chosen: dict[bytes, DiskEntry] = {}
        broken: set[bytes] = set()
        for entry in sorted(self.entries.values(), key=lambda e: e.last_access, reverse=True):
            if len(chosen) >= max_blocks:
                break
            chain = []
            hash_ = entry.hash
            while hash_ != ROOT_HASH and hash_ not in chosen:
                found = self.entries.get(hash_)
                if found is None or hash_ in broken:
                    broken.update(e.hash for e in chain)
                    chain = []
                    break
                chain.append(found)
                hash_ = found.parent_hash
            for found in reversed(chain[-(max_blocks - len(chosen)) :] if chain else ()):
                chosen[found.hash] = found
        return list(chosen.values())

    # -- writes -------------------------------------------------------------------

    def reserve(
        self,
        hash_: bytes,
        parent_hash: bytes,
        owner: bytes,
        shared: bool,
        owners: Iterable[bytes] = (),
    ) -> Reservation:
        """Make room for one more block; on success the hash counts as writing.

        Evicts least recently used leaves of the same or a lower class; a session
        block never pushes out a shared-prompt block. Not granted when the block
        is already stored or queued, or when no room can be made.
        """
        if hash_ in self.entries or hash_ in self.writing:
            return Reservation(False, ())
        if self.block_nbytes > self.budget_bytes:
            self.num_refused += 1
            return Reservation(False, ())
        evicted: list[DiskEntry] = []
        limit = SHARED if shared else SESSION
        while self.used_bytes + self.block_nbytes > self.budget_bytes:
            victim = self._pop_victim(limit)
            if victim is None:
                self.num_refused += 1
                # Nothing was taken for this write; what was evicted is gone anyway.
                return Reservation(False, tuple(evicted))
            evicted.append(victim)
        self.writing[hash_] = PendingWrite(hash_, parent_hash, owner, shared, owners)
        return Reservation(True, tuple(evicted))

    def finish_write(self, hash_: bytes, now: float, ok: bool) -> bool:
        """The queued write ended; returns whether the block is now indexed.

        A block forgotten while its write was queued is not indexed: its file is
        deleted by a job queued after the write.
        """
        pending = self.writing.pop(hash_, None)
        if pending is None or not ok or pending.doomed:
            return False
        self.add(hash_, pending.parent_hash, pending.owner, pending.shared, now, pending.owners)
        return True

    def add(
        self,
        hash_: bytes,
        parent_hash: bytes,
        owner: bytes,
        shared: bool,
        now: float,
        owners: Iterable[bytes] = (),
    ) -> None:
        """Index a complete file (a finished write, or one found at start-up)."""
        if hash_ in self.entries:
            return
        entry = DiskEntry(hash_, parent_hash, owner, shared, now, owners)
        self.entries[hash_] = entry
        self.children.setdefault(parent_hash, set()).add(hash_)
        if not self.children.get(hash_):
            self._push(entry)

    def add_owners(self, hash_: bytes, owners: Iterable[bytes]) -> None:
        """Sessions that used the block in memory (it leaves memory now)."""
        found = self.describe(hash_)
        if found is not None:
            found.owners.update(owners)

    # -- reads --------------------------------------------------------------------

    def touch(self, hashes: Iterable[bytes], now: float) -> None:
        """The blocks were used (a hit in any tier): they become most recent."""
        entries = self.entries
        for hash_ in hashes:
            entry = entries.get(hash_)
            if entry is not None and entry.last_access != now:
                entry.last_access = now
                if not self.children.get(hash_):
                    self._push(entry)

    # -- removal ------------------------------------------------------------------

    def remove(self, hash_: bytes) -> DiskEntry | PendingWrite | None:
        """Drop a block from the index and return it (the caller deletes its file);
        a queued write of it is marked so that its file is deleted, not indexed."""
        pending = self.writing.get(hash_)
        if pending is not None:
            pending.doomed = True
            return pending
        entry = self.entries.pop(hash_, None)
        if entry is None:
            return None
        siblings = self.children.get(entry.parent_hash)
        if siblings is not None:
            siblings.discard(hash_)
            if not siblings:
                del self.children[entry.parent_hash]
                parent = self.entries.get(entry.parent_hash)
                if parent is not None:
                    self._push(parent)
        return entry

    def set_budget(self, budget_bytes: int) -> list[DiskEntry]:
        """Change the budget; returns the blocks evicted to fit (any class)."""
        self.budget_bytes = max(0, int(budget_bytes))
        evicted = []
        while self.entries and self.used_bytes > self.budget_bytes:
            victim = self._pop_victim(SHARED)
            if victim is None:
                break
            evicted.append(victim)
        return evicted

    def _pop_victim(self, limit: int) -> DiskEntry | None:
        # Stale heap entries (touched since, no longer leaves, removed) are skipped.
        heap = self._heap
        while heap:
            cls, stamp, _, hash_ = heap[0]
            if cls > limit:
                return None
            heapq.heappop(heap)
            entry = self.entries.get(hash_)
            if entry is None or entry.last_access != stamp or self.children.get(hash_):
                continue
            self.remove(hash_)
            self.num_evicted += 1
            return entry
        return None

    def _push(self, entry: DiskEntry) -> None:
        cls = SHARED if entry.shared else SESSION
        heapq.heappush(self._heap, (cls, entry.last_access, next(self._seq), entry.hash))
        if len(self._heap) > 4 * len(self.entries) + 64:
            self._heap = [
                item
                for item in self._heap
                if (e := self.entries.get(item[3])) is not None and e.last_access == item[1]
            ]
            heapq.heapify(self._heap)

    # -- checks -------------------------------------------------------------------

    def check(self) -> None:
        """Raise AssertionError unless the forest and the byte count agree."""
        from .errors import CacheIntegrityError

        counted: dict[bytes, set[bytes]] = {}
        for hash_, entry in self.entries.items():
            if entry.hash != hash_:
                raise CacheIntegrityError(
                    f"disk entry {hash_.hex()[:8]} is filed under another hash"
                )
            counted.setdefault(entry.parent_hash, set()).add(hash_)
            if hash_ in self.writing:
                raise CacheIntegrityError(f"disk block {hash_.hex()[:8]} is stored and writing")
        for found in (*self.entries.values(), *self.writing.values()):
            if b"" in found.owners:
                raise CacheIntegrityError(f"disk block {found.hash.hex()[:8]} has an empty owner")
        if counted != self.children:
            raise CacheIntegrityError("the disk tier's children map disagrees with its entries")
        # Only a budget lowered at run time may leave more than it allows, and then
        # set_budget evicts stored blocks until none is left: queued writes remain.
        if self.entries and self.used_bytes > self.budget_bytes:
            raise CacheIntegrityError(
                f"disk tier uses {self.used_bytes} bytes of a {self.budget_bytes}-byte budget"
            )
