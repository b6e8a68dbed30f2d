"""Per-tier KV traffic as Prometheus metrics, read from the engine at scrape time.

Counters and the latency histogram are cumulative inside the engine
(``engine.cache_stats()``), so they are exposed through a collector rather
than incremented here:

    chatsvc_kv_loads_blocks_total{tier}, chatsvc_kv_loads_bytes_total{tier}
        blocks brought up from a tier (host: swap-ins; disk: verified loads)
    chatsvc_kv_stores_blocks_total{tier}, chatsvc_kv_stores_bytes_total{tier}
        blocks written down to a tier (host: swap-outs; disk: block files)
    chatsvc_kv_dropped_blocks_total{tier="disk", reason}
        corrupt | foreign | budget | queue_full | write_error
    chatsvc_kv_load_latency_seconds{tier="disk"}   histogram, queue to verified
    chatsvc_kv_disk_used_bytes, chatsvc_kv_disk_budget_bytes   gauges
    chatsvc_kv_disk_preload_blocks_total{outcome}
        the preload after a restart: blocks read into memory, used by loads, dropped
        unused (their loads count among the disk tier's loads too)
    chatsvc_speculative_tokens_total{outcome}
        speculative decoding's proposed tokens and those verification accepted
        (only where ``CHATSVC_SPECULATIVE`` is on)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


class TierTrafficCollector:
    """A prometheus_client collector over ``source()`` (the engine's cache_stats)."""

    def __init__(self, source: Callable[[], dict[str, Any]]) -> None:
        self._source = source

    def describe(self):
        # Describing must not call the engine (registration happens before scrapes).
        return list(self._families({}))

    def collect(self):
        try:
            stats = self._source()
        except Exception:  # noqa: BLE001 - an engine that stopped exports nothing
            return []
        return list(self._families(stats))

    def _families(self, stats: dict[str, Any]):
        block_bytes = int(stats.get("block_bytes", 0))
        disk = stats.get("disk") or {}
        loads_blocks = CounterMetricFamily(
            "chatsvc_kv_loads_blocks", "KV blocks brought up from a tier", labels=["tier"]
        )
        loads_bytes = CounterMetricFamily(
            "chatsvc_kv_loads_bytes", "Bytes of KV brought up from a tier", labels=["tier"]
        )
        stores_blocks = CounterMetricFamily(
            "chatsvc_kv_stores_blocks", "KV blocks written down to a tier", labels=["tier"]
        )
        stores_bytes = CounterMetricFamily(
            "chatsvc_kv_stores_bytes", "Bytes of KV written down to a tier", labels=["tier"]
        )
        dropped = CounterMetricFamily(
            "chatsvc_kv_dropped_blocks",
            "KV blocks a tier dropped or refused, by reason",
            labels=["tier", "reason"],
        )
        latency = HistogramMetricFamily(
            "chatsvc_kv_load_latency_seconds",
            "Time from queueing a block load to its verified arrival",
            labels=["tier"],
        )
        used = GaugeMetricFamily("chatsvc_kv_disk_used_bytes", "Bytes the disk KV tier holds")
        budget = GaugeMetricFamily("chatsvc_kv_disk_budget_bytes", "The disk KV tier's budget")
        preload = CounterMetricFamily(
            "chatsvc_kv_disk_preload_blocks",
            "KV blocks the preload after a restart read into memory, that loads used, "
            "and that it dropped unused",
            labels=["outcome"],
        )
        if stats:
            swapped_in = int(stats.get("swapped_in_blocks", 0))
            swapped_out = int(stats.get("swapped_out_blocks", 0))
            loads_blocks.add_metric(["host"], swapped_in)
            loads_bytes.add_metric(["host"], swapped_in * block_bytes)
            stores_blocks.add_metric(["host"], swapped_out)
            stores_bytes.add_metric(["host"], swapped_out * block_bytes)
        if "loaded_blocks" in disk:
            loads_blocks.add_metric(["disk"], disk["loaded_blocks"])
            loads_bytes.add_metric(["disk"], disk["loaded_bytes"])
            stores_blocks.add_metric(["disk"], disk["stored_blocks"])
            stores_bytes.add_metric(["disk"], disk["stored_bytes"])
            for reason, count in disk["dropped_blocks"].items():
                dropped.add_metric(["disk", reason], count)
            hist = disk["load_latency_s"]
            latency.add_metric(["disk"], list(hist["buckets"].items()), hist["sum"])
            used.add_metric([], disk["used_bytes"])
            budget.add_metric([], disk["budget_bytes"])
        speculative = CounterMetricFamily(
            "chatsvc_speculative_tokens",
            "Tokens speculative decoding proposed, and those verification accepted",
            labels=["outcome"],
        )
        if "speculative" in stats:
            for outcome in ("proposed", "accepted"):
                speculative.add_metric([outcome], stats["speculative"][f"{outcome}_tokens"])
        if "preload" in disk:
            for outcome in ("read", "used", "dropped"):
                preload.add_metric([outcome], disk["preload"][f"{outcome}_blocks"])
        traffic = [loads_blocks, loads_bytes, stores_blocks, stores_bytes, dropped]
        return [*traffic, latency, used, budget, preload, speculative]
