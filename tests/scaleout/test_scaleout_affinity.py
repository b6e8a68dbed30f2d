"""Affinity-miss accounting and the replica label, without a model or a server."""

from __future__ import annotations

import socket

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatsvc.affinity import AFFINITY_MISS, EVICTED, RESIDENT, AffinityTracker, HistoryTurn
from chatsvc.config import Settings, SettingsError
from chatsvc.metrics import Metrics, replica_label

B = 16


def _turn(sid: str, stored: int, cached: int, *, prior=True, extends=True, new=20, answer=8):
    prompt = stored + new
    return HistoryTurn(
        session_id=sid,
        stored_tokens=stored,
        prior_turns=prior,
        extends_history=extends,
        prompt_tokens=prompt,
        cached_tokens=cached,
        tokens_after=prompt + answer,
    )


def test_a_session_served_here_throughout_is_resident():
    tracker = AffinityTracker()
    assert tracker.observe(_turn("s", 30, 0, prior=False), B) is None  # first turn
    verdict = tracker.observe(_turn("s", 58, 48), B)  # 58 stored -> 48 reusable, all cached
    assert verdict.kind == RESIDENT and verdict.recomputed_tokens == 0


def test_a_session_new_to_this_replica_is_an_affinity_miss():
    tracker = AffinityTracker()
    # Stored elsewhere: 100 tokens, 96 in full blocks; only the shared system
    # prompt's first block was in this replica's cache.
    verdict = tracker.observe(_turn("moved", 100, 16), B)
    assert (verdict.kind, verdict.recomputed_tokens) == (AFFINITY_MISS, 80)
    # The next turn finds what this replica just computed.
    assert tracker.observe(_turn("moved", 128, 128), B).kind == RESIDENT
    snap = tracker.snapshot()
    assert snap["affinity_misses"] == 1 and snap["history_turns"] == 2
    assert snap["affinity_miss_rate"] == 0.5
    assert snap["recomputed_tokens"] == {AFFINITY_MISS: 80, EVICTED: 0}


def test_history_that_grew_elsewhere_is_a_miss_even_for_a_known_session():
    tracker = AffinityTracker()
    tracker.observe(_turn("s", 30, 0, prior=False), B)  # here: 58 tokens after turn 1
    # Turn 2 ran on another replica (history now 86); back here, 48 of 80 found.
    verdict = tracker.observe(_turn("s", 86, 48), B)
    assert (verdict.kind, verdict.recomputed_tokens) == (AFFINITY_MISS, 32)


def test_history_this_replica_computed_and_dropped_is_an_eviction():
    tracker = AffinityTracker()
    tracker.observe(_turn("s", 30, 0, prior=False), B)  # 58 tokens after
    verdict = tracker.observe(_turn("s", 58, 0), B)
    assert (verdict.kind, verdict.recomputed_tokens) == (EVICTED, 48)
    assert tracker.snapshot()["evicted_history_turns"] == 1


def test_partial_blocks_and_re_rendered_turns_are_not_misses():
    tracker = AffinityTracker()
    # 40 stored tokens: 32 in full blocks, all found; the last 8 never count.
    assert tracker.observe(_turn("a", 40, 32), B).kind == RESIDENT
    assert tracker.observe(_turn("b", 200, 0, extends=False), B) is None
    # Never the last prompt token: with no new tokens the reusable part stops short.
    assert tracker.observe(_turn("c", 32, 16, new=0), B).kind == RESIDENT
    # Nor the last stored token (sampled, never computed): 96 stored tokens fill
    # six blocks, but the sixth can never be cached.
    tracker.observe(_turn("d", 60, 0, prior=False, new=20, answer=16), B)  # 96 after
    assert tracker.observe(_turn("d", 96, 80), B).kind == RESIDENT


def test_the_session_memory_is_bounded_and_forgets_the_oldest():
    tracker = AffinityTracker(max_sessions=2)
    for sid in ("a", "b", "c"):
        tracker.observe(_turn(sid, 30, 0, prior=False), B)
    assert tracker.snapshot()["sessions_remembered"] == 2
    assert tracker.observe(_turn("a", 58, 0), B).kind == AFFINITY_MISS  # forgotten
    assert tracker.observe(_turn("c", 58, 0), B).kind == EVICTED  # remembered
    with pytest.raises(ValueError):
        AffinityTracker(max_sessions=0)


def _samples(metrics: Metrics) -> list:
    text = metrics.render().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def test_every_metric_carries_the_replica_label():
    metrics = Metrics(replica="r7")
    metrics.observe_request(
        "session_turn",
        prompt_tokens=10,
        cached_tokens=4,
        completion_tokens=3,
        ttft_s=0.1,
        tpot_s=0.01,
    )
    metrics.observe_history_turn(AFFINITY_MISS, 64)
    metrics.observe_history_turn(RESIDENT, 0)
    metrics.observe_history_turn(EVICTED, 16)
    samples = _samples(metrics)
    assert samples and all(s.labels.get("replica") == "r7" for s in samples)
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    r = (("replica", "r7"),)
    assert values[("chatsvc_affinity_misses_total", r)] == 1
    assert values[("chatsvc_history_turns_total", r)] == 3
    assert values[("chatsvc_history_evictions_total", r)] == 1
    recomputed = "chatsvc_history_recomputed_tokens_total"
    assert values[(recomputed, (("cause", "affinity_miss"), ("replica", "r7")))] == 64
    assert values[(recomputed, (("cause", "evicted"), ("replica", "r7")))] == 16
    hits = (("replica", "r7"), ("tier", "device"))  # an observation's hits count as device's
    assert values[("chatsvc_prefix_cache_hits_tokens_total", hits)] == 4


def test_the_replica_id_comes_from_the_settings_or_the_host_and_port():
    assert replica_label(Settings(port=8123)) == f"{socket.gethostname()}:8123"
    assert replica_label(Settings(replica_id="chatsvc-2")) == "chatsvc-2"
    env = {"CHATSVC_REPLICA_ID": "eu-1.r3"}
    assert Settings.from_env(env).replica_id == "eu-1.r3"
    for bad in ("", "has space", 'quote"', "x" * 65):
        with pytest.raises(SettingsError, match="replica id"):
            Settings(replica_id=bad).validate()


def test_the_fleet_row_sums_counts_and_recomputes_rates():
    from chatsvc.fleet_view import row, table, total

    def report(prompt, cached, turns, misses):
        return {
            "requests": {
                "overall": {"requests": 1, "prompt_tokens": prompt, "cached_tokens": cached}
            },
            "affinity": {
                "history_turns": turns,
                "affinity_misses": misses,
                "recomputed_tokens": {"affinity_miss": 16 * misses, "evicted": 0},
            },
        }

    rows = [row("a", report(100, 90, 10, 0)), row("b", report(300, 150, 10, 5))]
    fleet = total(rows)
    assert fleet["prompt_tokens"] == 400 and fleet["cached_tokens"] == 240
    assert fleet["hit_rate"] == 0.6  # 240 / 400, not the mean of 90 % and 50 %
    assert fleet["miss_rate"] == 0.25 and fleet["recomputed_tokens"] == 80
    assert "fleet" in table([*rows, fleet]).splitlines()[-1]
