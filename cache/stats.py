"""Counters for the admin endpoint and metrics.

Hits are counted per statistics label: a hit on a public block (inside a
shared system prompt) counts under "public", a private hit under the
tenant's label. Hit tokens are also counted per tier the block came from
("device", "host", "disk"), so their sum is the total. Tier usage is not
stored here; the manager adds it to the snapshot from the pools.
"""

from __future__ import annotations

from collections import Counter


class LabelStats:
    """Lookup and hit counters for one label."""

    __slots__ = ("lookups", "queried_tokens", "hit_tokens", "hit_blocks")

    def __init__(self) -> None:
        self.lookups = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.hit_blocks = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "lookups": self.lookups,
            "queried_tokens": self.queried_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_blocks": self.hit_blocks,
            "hit_rate": self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
        }


class CacheStats:
    """Cumulative cache counters (monotonic, reset only by a new manager)."""

    def __init__(self) -> None:
        self.total = LabelStats()
        self.by_label: dict[str, LabelStats] = {}
        self.blocks_indexed = 0
        self.blocks_reused = 0
        # reuse_counts[k] = indexed blocks that were reused exactly k times (k >= 1)
        self.reuse_counts: Counter[int] = Counter()
        self.evictions_to_host = 0
        self.evictions_dropped = 0
        self.swapped_in_blocks = 0
        self.swapped_out_blocks = 0
        self.cow_copies = 0
        self.hit_tokens_by_tier: Counter[str] = Counter({"device": 0, "host": 0, "disk": 0})

    def label(self, name: str) -> LabelStats:
        stats = self.by_label.get(name)
        if stats is None:
            stats = self.by_label[name] = LabelStats()
        return stats

    def record_query(self, label: str, num_tokens: int) -> None:
        self.total.lookups += 1
        self.total.queried_tokens += num_tokens
        stats = self.label(label)
        stats.lookups += 1
        stats.queried_tokens += num_tokens

    def record_hit(
        self, label: str, num_tokens: int, previous_hits: int, tier: str = "device"
    ) -> None:
        """One block reused; ``previous_hits`` is how often it had been reused before."""
        self.hit_tokens_by_tier[tier] += num_tokens
        self.total.hit_tokens += num_tokens
        self.total.hit_blocks += 1
        stats = self.label(label)
        stats.hit_tokens += num_tokens
        stats.hit_blocks += 1
        self.blocks_reused += 1
        if previous_hits:
            self.reuse_counts[previous_hits] -= 1
            if not self.reuse_counts[previous_hits]:
                del self.reuse_counts[previous_hits]
        self.reuse_counts[previous_hits + 1] += 1

    def reuse_histogram(self) -> dict[str, int]:
        """Blocks by reuse count in power-of-two buckets: "1", "2", "3-4", "5-8", ..."""
        buckets: Counter[int] = Counter()
        for count, num_blocks in self.reuse_counts.items():
            buckets[1 << (count - 1).bit_length()] += num_blocks
        out = {}
        for upper in sorted(buckets):
            lower = upper // 2 + 1
            out[str(upper) if lower >= upper else f"{lower}-{upper}"] = buckets[upper]
        return out

    def snapshot(self) -> dict:
        """A JSON-able dict of every counter."""
        return {
            "lookups": self.total.lookups,
            "queried_tokens": self.total.queried_tokens,
            "hit_tokens": self.total.hit_tokens,
            "hit_blocks": self.total.hit_blocks,
            "hit_rate": self.total.as_dict()["hit_rate"],
            "by_label": {name: s.as_dict() for name, s in sorted(self.by_label.items())},
            "blocks_indexed": self.blocks_indexed,
            "blocks_reused": self.blocks_reused,
            "reuse_histogram": self.reuse_histogram(),
            "evictions": {"to_host": self.evictions_to_host, "dropped": self.evictions_dropped},
            "swapped_in_blocks": self.swapped_in_blocks,
            "swapped_out_blocks": self.swapped_out_blocks,
            "cow_copies": self.cow_copies,
            "hit_tokens_by_tier": dict(self.hit_tokens_by_tier),
        }


def used_token_slots(seqs, block_size: int) -> int:
    """Token slots of referenced device blocks that hold (or are reserved for) a token.

    A block shared by several sequences counts once, with its fullest use, so
    ``used / (referenced blocks * block_size)`` is the pool's slot utilisation
    (1 - internal fragmentation) whatever the sharing.
    """
    filled: dict[int, int] = {}
    for seq in seqs:
        num_tokens = len(seq.token_ids)
        for index, block_id in enumerate(seq.table.block_ids):
            n = min(block_size, num_tokens - index * block_size)
            if n > filled.get(block_id, 0):
                filled[block_id] = n
    return sum(filled.values())
