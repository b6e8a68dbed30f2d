"""KVCacheManager: the facade the scheduler talks to (contract: docs/contracts.md).

Lifecycle of a sequence::

    allocate(seq, prompt)     map the longest cached prefix, fresh blocks for the rest
    mark_computed(seq, n)     KV of tokens [0, n) is written: full blocks join the index
    append_slots(seq, toks)   room for new tokens (copy-on-write into shared blocks)
    truncate(seq, n)          roll back appended tokens whose KV was never marked computed
    fork(seq, child)          child shares every block
    stop_indexing(seq)        what it fills from now on stays private (beams)
    free(seq)                 indexed blocks stay cached, the rest return to the pool

Every public method validates its input before changing anything, so an
exception leaves the cache exactly as it was.
"""

from __future__ import annotations

from .block_table import BlockTable
from .chain import BlockChain, checked_tokens
from .disk_index import DiskIndex
from .errors import DuplicateSequenceError, OutOfBlocksError, UnknownSequenceError
from .forget import ForgetResult, forget
from .hashing import BlockHasher
from .integrity import check_integrity
from .matching import PrefixMatcher
from .memory_tiers import TieredBlocks
from .namespace import PUBLIC_KEY, Namespace
from .pending import PendingBlocks
from .plan import (
    EMPTY_PLAN,
    AllocResult,
    AppendResult,
    BlockStore,
    DiskLoad,
    PlanBuilder,
    PrefixMatch,
)
from .prefix_index import DEVICE, HOST
from .sequence import Sequence
from .stats import CacheStats, used_token_slots

# What the prompt queries and ``allocate`` take: the token ids with their
# namespace, or a BlockChain (``chain``) that already carries both and keeps
# its hashes between calls (the scheduler holds one per waiting sequence).
Prompt = BlockChain | list[int]


class KVCacheManager:
    """Paged KV-cache bookkeeping: block tables, prefix index, device and host tiers."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        num_host_blocks: int = 0,
        enable_prefix_cache: bool = True,
        debug_checks: bool = False,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size!r}")
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be a non-negative int, got {num_host_blocks!r}")
        self.block_size = block_size
        self.enable_prefix_cache = bool(enable_prefix_cache)
        self.debug_checks = bool(debug_checks)
        self.stats = CacheStats()
        self.hasher = BlockHasher(block_size)
        self.tiers = TieredBlocks(num_blocks, num_host_blocks, self.stats)
        self._matcher = PrefixMatcher(self.tiers, block_size)
        self.pending = PendingBlocks(block_size)
        self._seqs: dict[object, Sequence] = {}
        self.disk: DiskIndex | None = None
        self._clock = None

    def attach_disk(self, disk: DiskIndex, clock, write_through: bool = True) -> None:
        """Put a disk tier under the memory tiers (see docs/cache.md, "Disk tier").

        A prompt's match continues into ``disk`` past the memory tiers, a block
        dropped from memory is stored there, and with ``write_through`` every
        newly indexed block is too (``take_stores``). ``clock()`` gives the
        wall-clock seconds used as the disk blocks' recency.
        """
        self.disk = disk
        self._clock = clock
        self.tiers.disk = disk
        self.tiers.new_nodes = [] if write_through else None

    # -- queries ------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.tiers.device.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` device blocks can be had (free + evictable)."""
        return num_blocks <= self.tiers.num_available

    def chain(self, token_ids, namespace: Namespace) -> BlockChain:
        """The prompt's block chain: pass it to the queries below and to ``allocate``
        in place of the token ids, and its blocks are hashed once for all of them.

        Extend it (``BlockChain.extend``) as the sequence's tokens grow.
        """
        return BlockChain(self.hasher, token_ids, namespace)

    def num_blocks_needed(self, token_ids: Prompt, namespace: Namespace) -> int:
        """Device blocks ``allocate`` would take from the free + evictable pool.

        That is the blocks after the cached prefix, plus one per matched block
        that must be swapped in from the host, plus one per matched cached block
        (it stops being evictable), so ``can_allocate(num_blocks_needed(...))``
        is exactly whether ``allocate`` succeeds. Changes nothing.
        """
        chain = self._prompt(token_ids, namespace)
        return self._blocks_needed(chain, self._match(chain))

    def num_matched_tokens(self, token_ids: Prompt, namespace: Namespace) -> int:
        """Leading prompt tokens ``allocate`` would take from the cache now.

        A multiple of block_size, never including the last prompt token (its
        KV must be computed for the logits). Changes nothing, not even LRU order.
        """
        return len(self._match(self._prompt(token_ids, namespace))) * self.block_size

    def match_prefix(
        self, token_ids: Prompt, namespace: Namespace, reuse_prefix: bool = True
    ) -> PrefixMatch:
        """Cached prefix, the pending blocks right after it, and the blocks needed.

        Pending tokens are those whose blocks another live sequence was
        allocated for and has not computed yet; admitting this prompt once they
        are written turns them into cache hits. ``reuse_prefix=False``: what
        ``allocate(..., reuse_prefix=False)`` would do (no match, nothing pending).
        Changes nothing.
        """
        chain = self._prompt(token_ids, namespace)
        matched = self._match(chain) if reuse_prefix else []
        num_pending = 0
        if self.enable_prefix_cache and reuse_prefix:
            num_pending = self.pending.extent(chain, len(matched))
        bs = self.block_size
        num_disk = len(self._match_disk(chain, matched)) if reuse_prefix else 0
        return PrefixMatch(
            len(matched) * bs,
            num_pending * bs,
            self._blocks_needed(chain, matched),
            num_disk * bs,
        )

    def block_table(self, seq_id) -> list[int]:
        return list(self._seq(seq_id).table.block_ids)

    def num_tokens(self, seq_id) -> int:
        return len(self._seq(seq_id).token_ids)

    def num_computed_tokens(self, seq_id) -> int:
        return self._seq(seq_id).num_computed

    def token_ids(self, seq_id) -> list[int]:
        return list(self._seq(seq_id).token_ids)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    @property
    def seq_ids(self) -> list:
        return list(self._seqs)

    # -- prompt admission ---------------------------------------------------------

    def allocate(
        self,
        seq_id,
        token_ids: Prompt,
        namespace: Namespace,
        owner: bytes = b"",
        reuse_prefix: bool = True,
    ) -> AllocResult:
        """Map the longest cached prefix of the prompt and allocate the rest.

        The block holding the last prompt token is never matched: its KV must be
        computed to get the logits. Raises OutOfBlocksError (state unchanged)
        when free + evictable device blocks do not suffice. Blocks the disk tier
        holds right after the memory prefix come back as ``loads`` (in the
        sequence's fresh blocks); ``owner`` tags the blocks it will index.
        ``reuse_prefix=False`` matches nothing in any tier (every prompt token is
        computed, e.g. for its logits) and records no lookup; the blocks still
        enter the index once computed.
        """
        if seq_id in self._seqs:
            raise DuplicateSequenceError(seq_id)
        chain = self._prompt(token_ids, namespace)
        matched = self._match(chain) if reuse_prefix else []
        needed = self._blocks_needed(chain, matched)
        if needed > self.tiers.num_available:
            raise OutOfBlocksError(needed, self.tiers.num_available, f"prompt of {seq_id!r}")
        on_disk = self._match_disk(chain, matched) if reuse_prefix else []
        if chain is token_ids:  # the caller's chain stays the caller's
            if self.enable_prefix_cache and chain.num_full_blocks:
                chain.hash(chain.num_full_blocks - 1)  # so both keep the prompt's hashes
            chain = chain.copy()

        tiers = self.tiers
        tick = tiers.index.advance()
        if reuse_prefix:
            self._record_lookup(chain, matched)
        plan = PlanBuilder()
        table = BlockTable()
        host_nodes = [node for node in matched if node.location == HOST]
        for node in host_nodes:
            node.pins += 1  # keeps them from being dropped by evictions below
        released_host: list[int] = []
        for node in matched:
            node.last_access = tick
            if owner and node.ns_key != PUBLIC_KEY:
                node.owners.add(owner)
            if node.location == DEVICE:
                tiers.ref_node(node)
                table.append(node.block_id)
            else:
                table.append(tiers.swap_in(node, plan, released_host))
                node.pins -= 1
        num_total = -(-chain.num_tokens // self.block_size)
        for _ in range(num_total - len(matched)):
            table.append(tiers.take_block(plan))
        tiers.release_host_blocks(released_host)

        num_cached = len(matched) * self.block_size
        last_node = matched[-1] if matched else tiers.index.root
        seq = Sequence(seq_id, chain, table, num_cached, len(matched), last_node)
        seq.owner = owner
        if self.enable_prefix_cache:
            self.pending.register(seq, len(matched))
        self._seqs[seq_id] = seq
        loads = ()
        if self.disk is not None:
            now = self._clock()
            self.disk.touch((node.hash for node in matched), now)
            self.disk.touch((block.hash for block in on_disk), now)
            loads = tuple(
                DiskLoad(
                    block.index,
                    table.block_ids[block.index],
                    block.hash,
                    block.parent_hash,
                    block.token_ids,
                    block.ns_key,
                )
                for block in on_disk
            )
        self._after_mutation()
        seq.num_loading = len(loads)
        return AllocResult(num_cached, plan.build(), loads, len(host_nodes) * self.block_size)

    def complete_load(self, seq_id, num_blocks: int) -> None:
        """The first ``num_blocks`` of the sequence's ``loads`` hold verified KV.

        They count as computed (and join the index) and as disk hits; the rest
        of the loads, if any failed, are computed like any uncached block.
        """
        seq = self._seq(seq_id)
        bs = self.block_size
        if type(num_blocks) is not int or not 0 <= num_blocks <= seq.num_loading:
            raise ValueError(
                f"num_blocks must be an int in [0, {seq.num_loading}] for {seq_id!r}, "
                f"got {num_blocks!r}"
            )
        seq.num_loading = 0
        if not num_blocks:
            return
        first = seq.num_computed // bs
        self.mark_computed(seq_id, (first + num_blocks) * bs)
        stats = self.stats
        node = seq.last_node if seq.num_indexed == first + num_blocks else None
        for i in reversed(range(first, first + num_blocks)):
            previous = 0
            if node is not None and node is not self.tiers.index.root:
                previous = node.num_hits
                node.num_hits += 1
                node = node.parent
            stats.record_hit(seq.namespace.stats_label(i, bs), bs, previous, tier="disk")

    def take_stores(self) -> list[BlockStore]:
        """Write-through: blocks indexed since the last call, to copy to the disk tier now.

        Call it before any later plan runs: a store names a device block whose
        KV is this node's only while the node keeps it.
        """
        new = self.tiers.new_nodes
        if not new:
            return []
        self.tiers.new_nodes = []
        disk = self.disk
        out = []
        for node in new:
            if node.parent is None or node.location != DEVICE:
                continue
            if disk.is_stored_or_writing(node.hash):
                continue
            out.append(
                BlockStore(
                    DEVICE,
                    node.block_id,
                    node.hash,
                    node.parent.hash,
                    node.token_ids,
                    node.ns_key == PUBLIC_KEY,
                    node.owner,
                    frozenset(node.owners),
                )
            )
        return out

    def forget(
        self,
        token_ids,
        namespace: Namespace,
        owner: bytes = b"",
        keep_tokens: int = 0,
        owned_below: bool = True,
    ) -> ForgetResult:
        """Delete a conversation's blocks from every tier unless something else uses them.

        ``token_ids``: the conversation's tokens; ``owner``: its session digest. With
        ``owned_below`` (a deleted session) the owner's blocks below that chain
        (unacknowledged turns) go too. Blocks of shared system prompts, blocks in
        use, blocks another session uses (their ``owners``) and blocks another chain
        hangs from are kept (``cache.forget``), and so are the blocks wholly inside
        the first ``keep_tokens`` (what a branch left shares). The disk blocks
        returned are already out of the index; the caller deletes their files.
        Costs O(the chain's and the owned blocks + live sequences).
        """
        history = BlockChain(self.hasher, token_ids, namespace)
        keep_blocks = max(0, int(keep_tokens)) // self.block_size
        running = any(seq.owner == owner for seq in self._seqs.values())
        result = forget(self.tiers, history, owner, keep_blocks, owned_below, release=not running)
        self._after_mutation()
        return result

    def _match_disk(self, chain: BlockChain, matched: list) -> list:
        """The chain's blocks the disk tier holds right after ``matched``.

        Within the matchable blocks like any match; changes nothing.
        """
        disk = self.disk
        if disk is None or not self.enable_prefix_cache or not len(disk):
            return []
        found = []
        for block in chain.blocks(len(matched), chain.num_matchable_blocks):
            if not disk.continues(block.hash, block.parent_hash):
                break
            found.append(block)
        return found

    def _prompt(self, token_ids: Prompt, namespace: Namespace) -> BlockChain:
        if isinstance(token_ids, BlockChain):
            chain = token_ids
            if chain.block_size != self.block_size or chain.namespace != namespace:
                raise ValueError("the prompt's chain has another block size or namespace")
        else:
            chain = BlockChain(self.hasher, token_ids, namespace)
        if not chain.num_tokens:
            raise ValueError("a prompt needs at least one token")
        return chain

    def _match(self, chain: BlockChain) -> list:
        return self._matcher.match(chain) if self.enable_prefix_cache else []

    def _blocks_needed(self, chain: BlockChain, matched: list) -> int:
        refcounts = self.tiers.device.refcounts
        num_total = -(-chain.num_tokens // self.block_size)
        needed = num_total - len(matched)
        for node in matched:
            if node.location == HOST:
                needed += 1
            elif refcounts[node.block_id] == 0 and node.pins == 0:
                needed += 1
        return needed

    def _record_lookup(self, chain: BlockChain, matched: list) -> None:
        stats = self.stats
        bs = self.block_size
        namespace = chain.namespace
        stats.record_query(namespace.label, chain.num_tokens)
        for i, node in enumerate(matched):
            stats.record_hit(namespace.stats_label(i, bs), bs, node.num_hits, node.location)
            node.num_hits += 1

    # -- decoding -----------------------------------------------------------------

    def append_slots(self, seq_id, token_ids) -> AppendResult:
        """Make room for new tokens and return the KV slot of each.

        Writing into a partially filled block that another table shares first
        copies it to a fresh block (``plan.copies``) and points this table there.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(seq_id)
        if not token_ids:
            raise ValueError("append_slots needs at least one token")
        token_ids = checked_tokens(token_ids)
        tiers = self.tiers
        bs = self.block_size
        blocks = seq.table.block_ids
        pos = len(seq.token_ids)
        offset = pos & (bs - 1)
        num_new = len(token_ids)
        cow = offset != 0 and tiers.device.refcounts[blocks[-1]] > 1
        needed = (pos + num_new + bs - 1) // bs - len(blocks) + cow
        plan = EMPTY_PLAN
        if needed:
            if needed > tiers.device.num_free + tiers.num_evictable:
                raise OutOfBlocksError(needed, tiers.num_available, f"append to {seq_id!r}")
            builder = PlanBuilder()
            if cow:
                shared = blocks[-1]
                fresh = tiers.take_block(builder)
                builder.copies.append((shared, fresh))
                blocks[-1] = fresh
                tiers.unref_block(shared)
                self.stats.cow_copies += 1
            for _ in range(needed - cow):
                blocks.append(tiers.take_block(builder))
            plan = builder.build()
        seq.token_ids.extend(token_ids)
        slots = _slots(blocks, bs, pos, num_new)
        if self.debug_checks:
            self.check_integrity()
        return AppendResult(slots, plan)

    @property
    def num_free_blocks(self) -> int:
        """Device blocks on the free list: what can be taken without evicting a cached one."""
        return self.tiers.device.num_free

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Drop the sequence's tokens from ``num_tokens`` on: tokens appended whose KV was
        never marked computed (speculative tokens that verification rejected).

        ``num_tokens`` may not cut below ``num_computed``: what is computed may be
        indexed already. The table shrinks to ``ceil(num_tokens / block_size)``
        blocks; those dropped were taken for the cut tokens alone (fresh, private,
        never indexed), so they return to the free list at once.
        """
        seq = self._seq(seq_id)
        if type(num_tokens) is not int or not seq.num_computed <= num_tokens <= len(seq.token_ids):
            raise ValueError(
                f"num_tokens must be an int in [{seq.num_computed}, {len(seq.token_ids)}] "
                f"for {seq_id!r}, got {num_tokens!r}"
            )
        keep = -(-num_tokens // self.block_size)
        blocks = seq.table.block_ids
        dropped = blocks[keep:]
        del blocks[keep:]
        seq.chain.truncate(num_tokens)
        for block in dropped:
            self.tiers.unref_block(block)
        self._after_mutation()

    def prefill_slots(self, seq_id, num_tokens: int) -> list[int]:
        """The KV slots of the sequence's next ``num_tokens`` tokens without KV.

        Those tokens already have blocks (``allocate`` maps the whole prompt):
        the slots of a prefill chunk. Changes nothing.
        """
        seq = self._seq(seq_id)
        start = seq.num_computed
        if type(num_tokens) is not int or not 0 < num_tokens <= len(seq.token_ids) - start:
            raise ValueError(
                f"num_tokens must be an int in [1, {len(seq.token_ids) - start}] "
                f"for {seq_id!r}, got {num_tokens!r}"
            )
        return _slots(seq.table.block_ids, self.block_size, start, num_tokens)

    def mark_computed(self, seq_id, num_tokens: int) -> None:
        """Record that the KV of tokens [0, num_tokens) is written.

        Newly full blocks enter the prefix index. If an identical block is
        already indexed (another sequence computed the same prefix), the
        indexed one is kept and this sequence's copy stays private.
        """
        seq = self._seq(seq_id)
        if type(num_tokens) is not int or not seq.num_computed <= num_tokens <= len(seq.token_ids):
            raise ValueError(
                f"num_tokens must be an int in [{seq.num_computed}, {len(seq.token_ids)}] "
                f"for {seq_id!r}, got {num_tokens!r}"
            )
        seq.num_computed = num_tokens
        num_full = num_tokens // self.block_size
        if seq.pending:
            self.pending.resolve(seq, num_full)
        if self.enable_prefix_cache and not seq.index_stopped:
            if num_full > seq.num_indexed:
                self.tiers.index.advance()
                self._matcher.index_computed(seq, num_full)
        self._after_mutation()

    def num_append_blocks(self, seq_ids, num_tokens: int = 1) -> int:
        """Device blocks ``append_slots`` of ``num_tokens`` tokens to each of ``seq_ids`` in
        turn would take now (distinct ids); changes nothing.

        Fresh blocks past each sequence's last one; a copy where its last block is
        partial and shared. Sharers of one partial block copy it one after another, and
        when every holder is among ``seq_ids`` the last one finds it alone and writes in
        place (the beams of a request, forked from one parent: W sharers, W - 1 copies).
        So ``can_allocate(num_append_blocks(ids, n))`` is exactly whether those appends
        fit (beams: one token each; a speculative decode: one sequence, its proposals).
        """
        seq_ids = list(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("num_append_blocks takes distinct sequence ids")
        if type(num_tokens) is not int or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        bs = self.block_size
        sharers: dict[int, int] = {}
        needed = 0
        for seq_id in seq_ids:
            seq = self._seq(seq_id)
            blocks = seq.table.block_ids
            needed += (len(seq.token_ids) + num_tokens + bs - 1) // bs - len(blocks)
            if len(seq.token_ids) % bs != 0:
                sharers[blocks[-1]] = sharers.get(blocks[-1], 0) + 1
        refcounts = self.tiers.device.refcounts
        for block, count in sharers.items():
            needed += count - 1 if refcounts[block] == count else count
        return needed

    # -- forking and freeing ------------------------------------------------------

    def stop_indexing(self, seq_id) -> None:
        """The blocks the sequence fills from now on stay private: they never enter the
        prefix index, so each returns to the free list as soon as no table holds it.

        Its forks inherit this; what is indexed already stays. For beam search: a
        pruned beam's blocks are released at once instead of lingering as cached
        blocks no request will ask for (and evicting ones that would be).
        """
        self._seq(seq_id).index_stopped = True

    def fork(self, parent_seq_id, child_seq_id) -> None:
        """The child shares every block of the parent (copy-on-write on first write)."""
        parent = self._seq(parent_seq_id)
        if child_seq_id in self._seqs:
            raise DuplicateSequenceError(child_seq_id)
        child = parent.fork(child_seq_id)
        device = self.tiers.device
        for block in child.table.block_ids:
            device.incref(block)
        for node in child.pinned:
            self.tiers.pin(node)
        self._seqs[child_seq_id] = child
        self._after_mutation()

    def free(self, seq_id) -> None:
        """Drop the sequence: indexed blocks become cached, the rest are freed."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequenceError(seq_id)
        if seq.pending:
            self.pending.drop(seq)
        tiers = self.tiers
        tiers.index.advance()
        tiers.unref_blocks(seq.table.block_ids)
        for node in seq.pinned:
            tiers.unpin(node)
        self._after_mutation()

    # -- statistics and checks ----------------------------------------------------

    def stats_snapshot(self) -> dict:
        """Counters plus tier usage, as a JSON-able dict."""
        snapshot = self.stats.snapshot()
        snapshot.update(self.tiers.usage())
        snapshot["num_sequences"] = len(self._seqs)
        snapshot["pending_blocks"] = len(self.pending)
        snapshot["device"]["used_token_slots"] = used_token_slots(
            self._seqs.values(), self.block_size
        )
        disk = self.disk
        if disk is not None:
            snapshot["disk"] = {
                "blocks": len(disk),
                "writing": len(disk.writing),
                "used_bytes": disk.used_bytes,
                "budget_bytes": disk.budget_bytes,
                "evicted_blocks": disk.num_evicted,
                "refused_writes": disk.num_refused,
            }
        return snapshot

    def check_integrity(self) -> None:
        """Raise CacheIntegrityError if any bookkeeping invariant is broken."""
        seqs = list(self._seqs.values())
        check_integrity(self.tiers, seqs, self.block_size)
        self.pending.check(seqs)
        if self.disk is not None:
            self.disk.check()

    def _seq(self, seq_id) -> Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(seq_id)
        return seq

    def _after_mutation(self) -> None:
        if self.debug_checks:
            self.check_integrity()


def _slots(blocks: list[int], block_size: int, start: int, count: int) -> list[int]:
    """The slot (``block * block_size + offset``) of each position ``start, ...``."""
    if count == 1:
        return [blocks[start // block_size] * block_size + start % block_size]
    stop = start + count
    return [blocks[p // block_size] * block_size + p % block_size for p in range(start, stop)]
