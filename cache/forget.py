"""Deleting a conversation's KV from every tier (KV can be inverted to text).

A session's blocks are the chain of its token history in the tenant's
namespace, plus whatever the same session computed below that chain and never
stored (an aborted or unacknowledged turn): its nodes carry the session's
owner digest. Among those candidates a block is removed only when nothing
else still needs it::

    session A   [ pub ][ pub ][ a2 ][ a3 ][ a4 ][ a5 ]
                                      |            \\
    session B                         +-[ b4 ]      [ x6 ]  owner A, never stored

    removed: x6, a5, a4 (deepest first); a3 stays (B uses it, b4 hangs from it),
    so do a2 and the public blocks of the shared system prompt

Who uses a private block is known without asking the store: every sequence of
a session adds the session's digest to the ``owners`` of each private block it
computes or matches (``PrefixNode.owners``, handed to the disk tier's entry when
the block leaves memory). Forgetting takes the session out of the owners of
every candidate, then, walking deepest first, removes a candidate when it is
private, no other session is among its owners, no table references or pins it,
and every child it has, in memory or on disk, was removed before it. The cost
is the chain's blocks and the owned ones below it, whatever the number of the
tenant's other sessions.

Forgetting text a session no longer holds (a deleted branch or message) skips
the owner walk (the session's other branches hang below the same blocks) and
keeps the leading ``keep_blocks`` that a branch left still holds.
"""

from __future__ import annotations

from typing import NamedTuple

import xxhash

from .chain import BlockChain
from .memory_tiers import TieredBlocks
from .namespace import PUBLIC_KEY
from .prefix_index import DEVICE, PrefixNode


class ForgetResult(NamedTuple):
    """What ``forget`` removed: blocks per memory tier, and disk blocks whose files go
    (``DiskEntry`` or ``PendingWrite``: hash, parent_hash, owner, shared)."""

    device_blocks: int
    host_blocks: int
    disk_blocks: tuple
    kept_blocks: int


class _Candidate:
    __slots__ = ("hash", "depth", "node", "public")

    def __init__(self, hash_: bytes, depth: int, node: PrefixNode | None, public: bool) -> None:
        self.hash = hash_
        self.depth = depth
        self.node = node
        self.public = public


def forget(
    tiers: TieredBlocks,
    history: BlockChain,
    owner: bytes,
    keep_blocks: int = 0,
    owned_below: bool = True,
    release: bool = True,
) -> ForgetResult:
    """Remove the blocks of ``history`` past ``keep_blocks``, and with ``owned_below``
    ``owner``'s blocks below it, that no one else uses (see module doc).

    ``release``: take ``owner`` out of the candidates' owners (False while a
    sequence of that owner still runs: it keeps using them).
    """
    disk = tiers.disk
    chain = _cached_blocks(tiers, history)
    candidates = {h: c for h, c in chain.items() if c.depth >= keep_blocks}
    num_kept = len(chain) - len(candidates)
    if owner and owned_below:
        _add_owned_descendants(tiers, chain, candidates, owner)
    removed: set[bytes] = set()
    num_device = num_host = 0
    disk_blocks: list = []
    for cand in sorted(candidates.values(), key=lambda c: c.depth, reverse=True):
        node = cand.node
        if _used_by_others(tiers, cand, owner, release) or cand.public:
            num_kept += 1
            continue
        if not _children(tiers, cand.hash, node) <= removed:
            num_kept += 1
            continue
        if node is not None:
            if node.location == DEVICE:
                if node.pins or tiers.device.refcounts[node.block_id]:
                    num_kept += 1
                    continue
                tiers.drop_cached_node(node)
                num_device += 1
            else:
                tiers.drop_host_node(node)
                num_host += 1
        if disk is not None:
            gone = disk.remove(cand.hash)
            if gone is not None:
                disk_blocks.append(gone)
        removed.add(cand.hash)
    return ForgetResult(num_device, num_host, tuple(disk_blocks), num_kept)


def _used_by_others(tiers, cand: _Candidate, owner: bytes, release: bool) -> bool:
    """Whether a session other than ``owner`` uses the block (in memory or on disk);
    with ``release``, ``owner`` stops counting as one of its users first."""
    found = [cand.node.owners] if cand.node is not None else []
    entry = tiers.disk.describe(cand.hash) if tiers.disk is not None else None
    if entry is not None:
        found.append(entry.owners)
    others = False
    for owners in found:
        if release:
            owners.discard(owner)
        others = others or bool(owners - {owner})
    return others


def owner_digest(tenant_salt: bytes, session_key: str) -> bytes:
    """The owner tag of a session's blocks: 8 bytes, keyed by the tenant's secret salt,
    so file names and memory never carry the session id itself."""
    return xxhash.xxh3_64_digest(b"owner\0" + tenant_salt + session_key.encode())


def _cached_blocks(tiers, history: BlockChain) -> dict[bytes, _Candidate]:
    # The memory index is a tree, so once a block misses there, no later block of
    # the chain can be in memory; the disk tier may still hold later ones.
    index = tiers.index
    disk = tiers.disk
    out: dict[bytes, _Candidate] = {}
    parent = index.root
    for block in history.blocks(0, history.num_full_blocks):
        hash_ = block.hash
        node = (
            index.lookup(parent, hash_, block.token_ids, block.ns_key)
            if parent is not None
            else None
        )
        on_disk = disk is not None and disk.is_stored_or_writing(hash_)
        if node is not None or on_disk:
            out[hash_] = _Candidate(hash_, block.index, node, block.ns_key == PUBLIC_KEY)
        parent = node
    return out


def _add_owned_descendants(tiers, chain, candidates: dict[bytes, _Candidate], owner: bytes):
    # From every block of the chain, kept ones included: an unstored turn of this
    # session may hang below a block another session shares.
    disk = tiers.disk
    stack = list(chain.values())
    while stack:
        cand = stack.pop()
        for child_hash, child in _child_items(tiers, cand.hash, cand.node):
            if child_hash in chain or child_hash in candidates:
                continue
            if child is not None:
                child_owner, public = child.owner, child.ns_key == PUBLIC_KEY
            else:
                entry = disk.describe(child_hash) if disk is not None else None
                if entry is None:
                    continue
                child_owner, public = entry.owner, entry.shared
            if child_owner != owner:
                continue
            found = _Candidate(child_hash, cand.depth + 1, child, public)
            candidates[child_hash] = found
            stack.append(found)


def _child_items(tiers, hash_: bytes, node: PrefixNode | None):
    """(hash, memory node or None) of every child, in memory or on disk."""
    seen = {}
    if node is not None:
        seen.update(node.children)
    disk = tiers.disk
    if disk is not None:
        for child in disk.child_hashes(hash_) | disk.writing_children(hash_):
            seen.setdefault(child, None)
    return seen.items()


def _children(tiers, hash_: bytes, node: PrefixNode | None) -> set[bytes]:
    found = set(node.children) if node is not None else set()
    disk = tiers.disk
    if disk is not None:
        found |= disk.child_hashes(hash_)
        found |= disk.writing_children(hash_)
    return found
