"""Counters of the disk tier's traffic, for /admin/cache and /metrics (engine thread only)."""

from __future__ import annotations

import bisect

# Upper bounds (seconds) of the load latency histogram, submit to verified.
LOAD_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
DROP_REASONS = ("corrupt", "foreign", "budget", "queue_full", "write_error")


class DiskStats:
    """Cumulative: loads and stores in blocks and bytes, latencies, drops by reason."""

    def __init__(self) -> None:
        self.loaded_blocks = 0
        self.loaded_bytes = 0
        self.load_misses = 0  # loads that found no usable block (missing, mismatch, error)
        self.stored_blocks = 0
        self.stored_bytes = 0
        self.deleted_blocks = 0  # removed on request (a deleted session)
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.write_errors = 0
        self._latency_counts = [0] * (len(LOAD_LATENCY_BUCKETS) + 1)
        self._latency_sum = 0.0

    def observe_load(self, latency_s: float) -> None:
        self._latency_counts[bisect.bisect_left(LOAD_LATENCY_BUCKETS, latency_s)] += 1
        self._latency_sum += latency_s

    def latency_histogram(self) -> dict:
        """Cumulative bucket counts (Prometheus style), their sum and count."""
        cumulative, running = [], 0
        for count in self._latency_counts:
            running += count
            cumulative.append(running)
        buckets = {str(b): c for b, c in zip(LOAD_LATENCY_BUCKETS, cumulative, strict=False)}
        buckets["+Inf"] = cumulative[-1]
        return {"buckets": buckets, "sum": self._latency_sum, "count": cumulative[-1]}

    def snapshot(self) -> dict:
        return {
            "loaded_blocks": self.loaded_blocks,
            "loaded_bytes": self.loaded_bytes,
            "load_misses": self.load_misses,
            "stored_blocks": self.stored_blocks,
            "stored_bytes": self.stored_bytes,
            "deleted_blocks": self.deleted_blocks,
            "dropped_blocks": dict(self.dropped),
            "write_errors": self.write_errors,
            "load_latency_s": self.latency_histogram(),
        }
