"""Prometheus metrics of the service, on a registry of its own.

Prefix-cache queries and hits are counted in tokens as counters, hits with a
``tier`` label (device, host, disk), so
``sum(rate(chatsvc_prefix_cache_hits_tokens_total[5m])) /
rate(chatsvc_prefix_cache_queries_tokens_total[5m])`` is the hit rate over a
window (the convention of vLLM's metrics) and ``{tier="disk"}`` its disk part.
KV occupancy and tier traffic are sampled from the engine at scrape time
rather than pushed on every step (``chatsvc.kv_metrics``).

Every sample carries a ``replica`` label (``CHATSVC_REPLICA_ID``, default
``<hostname>:<port>``), so a fleet's series stay apart however they are
scraped or federated; docs/scale-out.md has the fleet's PromQL.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def replica_label(settings: Any) -> str:
    """This process's ``replica`` label: the configured id, else ``<hostname>:<port>``."""
    if settings.replica_id is not None:
        return settings.replica_id
    return f"{socket.gethostname()}:{settings.port}"


class _WithReplica:
    """A view of a registry whose every sample also carries ``replica="<id>"``."""

    def __init__(self, registry: CollectorRegistry, replica: str) -> None:
        self._registry = registry
        self._replica = replica

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            relabeled = Metric(family.name, family.documentation, family.type, family.unit)
            relabeled.samples = [
                sample._replace(labels={**sample.labels, "replica": self._replica})
                for sample in family.samples
            ]
            yield relabeled


class Metrics:
    """The service's collectors. One instance per app, so tests never share counters."""

    def __init__(self, replica: str | None = None) -> None:
        self.replica = replica
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.cache_queries = Counter(
            "chatsvc_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache",
            registry=r,
        )
        self.cache_hits = Counter(
            "chatsvc_prefix_cache_hits_tokens",
            "Prompt tokens served from the prefix cache, by the tier they came from",
            ["tier"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "chatsvc_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "chatsvc_generation_tokens", "Generated tokens of finished requests", registry=r
        )
        self.requests = Counter(
            "chatsvc_requests",
            "Generation requests by endpoint and outcome",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "chatsvc_time_to_first_token_seconds",
            "Time from submission to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "chatsvc_time_per_output_token_seconds",
            "Mean time per generated token after the first, per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.kv_blocks_used = Gauge(
            "chatsvc_kv_cache_blocks_used",
            "KV blocks holding data (referenced or cached) per tier",
            ["tier"],
            registry=r,
        )
        self.kv_blocks_total = Gauge(
            "chatsvc_kv_cache_blocks_total", "KV blocks per tier", ["tier"], registry=r
        )
        self.kv_usage = Gauge(
            "chatsvc_kv_cache_usage_ratio",
            "Fraction of a tier's KV blocks in use",
            ["tier"],
            registry=r,
        )
        # Session turns whose prompt extends a stored history (chatsvc/affinity.py).
        self.history_turns = Counter(
            "chatsvc_history_turns",
            "Stored session turns that extended a stored history",
            registry=r,
        )
        self.affinity_misses = Counter(
            "chatsvc_affinity_misses",
            "History turns that recomputed history this replica never computed",
            registry=r,
        )
        self.history_evictions = Counter(
            "chatsvc_history_evictions",
            "History turns that recomputed history this replica computed, then evicted",
            registry=r,
        )
        self.history_recomputed_tokens = Counter(
            "chatsvc_history_recomputed_tokens",
            "Stored-history tokens recomputed, by cause (affinity_miss, evicted)",
            ["cause"],
            registry=r,
        )
        # Requests past their tenant's request rate (chatsvc/api/shared/request_rate.py).
        self.rate_limited = Counter(
            "chatsvc_rate_limited_requests",
            "Requests past their tenant's request rate: delayed (waited for their "
            "token, then ran) or refused (429)",
            ["outcome"],
            registry=r,
        )
        # Connections the HTTP server's guards cut (chatsvc/api/http_server.py).
        self.connections_cut = Counter(
            "chatsvc_connections_cut",
            "Connections closed on a slow client: head_timeout (no request head within "
            "its deadline) or linger_limit (still sending a refused body when the "
            "lingering close ended)",
            ["reason"],
            registry=r,
        )
        self._tiers: Callable[[], dict[str, tuple[int, int]]] | None = None

    def sample_tiers_with(self, tiers: Callable[[], dict[str, tuple[int, int]]]) -> None:
        """Register the source of per-tier (used, total) block counts read at scrape time."""
        self._tiers = tiers

    def sample_tier_traffic_with(self, source: Callable[[], dict[str, Any]]) -> None:
        """Register the engine's ``cache_stats`` as the source of per-tier traffic metrics."""
        from chatsvc.kv_metrics import TierTrafficCollector

        self.registry.register(TierTrafficCollector(source))

    def observe_request(
        self,
        endpoint: str,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        ttft_s: float | None,
        tpot_s: float | None,
        cached_by_tier: dict[str, int] | None = None,
    ) -> None:
        """Record one finished generation (per prompt, not per sample)."""
        self.requests.labels(endpoint=endpoint, status="ok").inc()
        self.cache_queries.inc(prompt_tokens)
        by_tier = cached_by_tier or {"device": cached_tokens}
        for tier in ("device", "host", "disk"):
            self.cache_hits.labels(tier=tier).inc(by_tier.get(tier, 0))
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None and completion_tokens > 1:
            self.tpot.observe(tpot_s)

    def observe_failure(self, endpoint: str, status: str) -> None:
        self.requests.labels(endpoint=endpoint, status=status).inc()

    def observe_history_turn(self, kind: str, recomputed_tokens: int) -> None:
        """Count a history turn by its verdict: resident, evicted or affinity_miss."""
        self.history_turns.inc()
        if kind == "affinity_miss":
            self.affinity_misses.inc()
        elif kind == "evicted":
            self.history_evictions.inc()
        if kind != "resident":
            self.history_recomputed_tokens.labels(cause=kind).inc(recomputed_tokens)

    def render(self) -> bytes:
        if self._tiers is not None:
            for tier, (used, total) in self._tiers().items():
                self.kv_blocks_used.labels(tier=tier).set(used)
                self.kv_blocks_total.labels(tier=tier).set(total)
                self.kv_usage.labels(tier=tier).set(used / total if total else 0.0)
        if self.replica is None:
            return generate_latest(self.registry)
        return generate_latest(_WithReplica(self.registry, self.replica))


class UsageStats:
    """Prompt-token cache usage aggregated by label (tenant, system prompt) for /admin/cache.

    The engine knows hits per block; only the service knows which tenant and
    which system prompt a request belonged to, so the per-label view is kept here.
    """

    def __init__(self) -> None:
        self._by: dict[str, dict[str, list[int]]] = {"tenant": {}, "system_prompt": {}}
        self._total = [0, 0, 0, 0]

    def record(self, labels: dict[str, str], prompt_tokens: int, cached_tokens: int) -> None:
        row = (1, prompt_tokens, cached_tokens, 0)
        self._add(self._total, row)
        for kind, table in self._by.items():
            key = labels.get(kind)
            if key is not None:
                self._add(table.setdefault(key, [0, 0, 0, 0]), row)

    def record_lost_reuse(self, labels: dict[str, str]) -> None:
        """A turn whose template re-rendered history, so its prompt could not extend the cache."""
        row = (0, 0, 0, 1)
        self._add(self._total, row)
        for kind, table in self._by.items():
            key = labels.get(kind)
            if key is not None:
                self._add(table.setdefault(key, [0, 0, 0, 0]), row)

    @staticmethod
    def _add(acc: list[int], row: tuple[int, int, int, int]) -> None:
        for i, value in enumerate(row):
            acc[i] += value

    @staticmethod
    def _view(acc: list[int]) -> dict[str, Any]:
        requests, queried, hit, lost = acc
        return {
            "requests": requests,
            "prompt_tokens": queried,
            "cached_tokens": hit,
            "token_hit_rate": hit / queried if queried else 0.0,
            "reuse_lost_turns": lost,
        }

    def snapshot(self) -> dict[str, Any]:
        return {
            "overall": self._view(self._total),
            "per_tenant": {k: self._view(v) for k, v in sorted(self._by["tenant"].items())},
            "per_system_prompt": {
                k: self._view(v) for k, v in sorted(self._by["system_prompt"].items())
            },
        }
