"""KV memory figures: admin samples and the client-side static-allocation comparison."""

from __future__ import annotations

import pytest

from bench.multiturn.client import RequestRecord
from bench.multiturn.memory import slots_from_admin, static_allocation, summarize_admin


def _rec(sent_at, ttft, latency, prompt, completion):
    return RequestRecord(
        "s",
        "c",
        0,
        sent_at,
        ttft_s=ttft,
        latency_s=latency,
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


def test_static_allocation_single_request_holding_its_prompt():
    # One request alive for the whole window, emitting its only token at the very end:
    # it holds its 30 prompt tokens all along, against 100 reserved slots.
    summary = static_allocation([_rec(0.0, 1.0, 1.0, 30, 0)], max_len=100, num_points=10)
    assert summary.mean_used_slots == pytest.approx(30)
    assert summary.mean_allocated_slots == pytest.approx(100)
    assert summary.waste_pct == pytest.approx(70)


def test_static_allocation_counts_generated_tokens_linearly():
    # Prompt 20, first token at t=0 (ttft 0), 10 tokens spread over [0, 1): mean held
    # = 20 + 10 * mean(t) = 25 over evenly spaced midpoints.
    summary = static_allocation([_rec(0.0, 0.0, 1.0, 20, 10)], max_len=50, num_points=100)
    assert summary.mean_used_slots == pytest.approx(25)
    assert summary.waste_pct == pytest.approx(50)


def test_static_allocation_ignores_idle_time_and_errors():
    records = [_rec(0.0, 1.0, 1.0, 40, 0), _rec(3.0, 1.0, 1.0, 40, 0)]
    records.append(RequestRecord("s", "c", 1, 0.5, error="boom"))
    summary = static_allocation(records, max_len=80, num_points=40)
    # Idle between t=1 and t=3 is not counted; each busy point holds 40 of 80.
    assert summary.waste_pct == pytest.approx(50)
    assert static_allocation([], max_len=80) is None


def test_admin_slots_from_ours_block_counts():
    body = {"engine": {"device": {"total": 100, "free": 90, "used": 4, "cached": 6}}}
    assert slots_from_admin(body, block_size=16) == (64.0, None)
    assert slots_from_admin({"engine": {"hit_rate": 0.5}}) is None
    samples = [{"t": 0.0, "body": body}, {"t": 0.1, "body": {"engine": {"device": {"used": 2}}}}]
    summary = summarize_admin(samples, block_size=16)
    assert summary.mean_allocated_slots == 48 and summary.peak_allocated_slots == 64
    assert summary.waste_pct is None and summary.mean_used_slots is None


def test_admin_waste_bound_from_live_sequences():
    samples = [
        {"t": 0, "body": {"engine": {"device": {"used": 10}, "num_sequences": 2, "block_size": 8}}},
        {"t": 1, "body": {"engine": {"device": {"used": 6}, "num_sequences": 4, "block_size": 8}}},
    ]
    # (2 * 7 + 4 * 7) empty slots at most, over (80 + 48) allocated.
    assert summarize_admin(samples).waste_bound_pct == pytest.approx(100 * 42 / 128)
    assert summarize_admin(samples).mean_allocated_slots == 64


def test_admin_waste_when_used_slots_are_reported():
    samples = [
        {"t": 0.0, "body": {"engine": {"device": {"used": 4}, "used_token_slots": 60}}},
        {"t": 0.1, "body": {"allocated_token_slots": 32, "used_token_slots": 30}},
        {"t": 0.2, "body": {"allocated_token_slots": 0, "used_token_slots": 0}},
    ]
    summary = summarize_admin(samples, block_size=16)
    assert summary.samples == 2
    assert summary.waste_pct == pytest.approx(100 * (1 - 90 / 96))
    assert summarize_admin(samples[2:]) is None
