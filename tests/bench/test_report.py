"""Report figures on a synthetic result whose numbers are worked out by hand."""

from __future__ import annotations

import pytest

from bench.multiturn.report import markdown_table, percentile, plot, summarize_system


def _rec(turn, ttft, latency, prompt, cached, completion, tpot=None, error=None):
    return {
        "turn": turn,
        "ttft_s": ttft,
        "latency_s": latency,
        "tpot_s": tpot,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "error": error,
    }


RESULT = {
    "meta": {},
    "systems": {
        "ours": {
            "wall_s": 10.0,
            "records": [
                _rec(0, 0.4, 1.0, 100, 0, 10, tpot=0.05),
                _rec(1, 0.2, 0.8, 200, 96, 10, tpot=0.05),
                _rec(2, 0.1, 0.5, 300, 288, 20, tpot=0.02),
                _rec(3, 0.3, 0.9, 400, 384, 20, tpot=0.03),
                _rec(3, None, None, None, None, None, error="HTTP 500"),
                {**_rec(3, None, None, None, None, None), "cut_at_deadline": True},
            ],
            "truncated": True,
            "ideal": {"prompt_tokens": 1000, "cached_tokens": 800},
            "ideal_causal": {"prompt_tokens": 1000, "cached_tokens": 768},
            "admin_memory": {
                "samples": 3,
                "mean_allocated_slots": 100.0,
                "mean_used_slots": 97.0,
                "peak_allocated_slots": 120.0,
                "waste_pct": 3.0,
            },
        },
        "hf": {
            "wall_s": 20.0,
            "records": [_rec(0, 1.0, 2.0, 100, None, 8), _rec(2, 2.0, 3.0, 300, None, 12)],
            "ideal": {"prompt_tokens": 400, "cached_tokens": 96},
        },
    },
}


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([10, 20], 90) == pytest.approx(19)
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_summary_of_ours():
    s = summarize_system(RESULT["systems"]["ours"])
    assert s["requests"] == 6 and s["errors"] == 1
    assert s["cut_at_deadline"] == 1 and s["truncated"]
    assert s["prompt_tokens"] == 1000 and s["cached_tokens"] == 768
    assert s["hit_rate"] == pytest.approx(0.768)
    assert s["ideal_hit_rate"] == pytest.approx(0.8)
    assert s["ideal_hit_ratio"] == pytest.approx(0.96)
    assert s["causal_hit_rate"] == pytest.approx(0.768)
    assert s["causal_hit_ratio"] == pytest.approx(1.0)
    assert s["requests_per_s"] == pytest.approx(0.4)
    assert s["output_tokens_per_s"] == pytest.approx(6.0)
    # turn >= 3 (index 2 on): TTFT 0.1 and 0.3
    assert s["ttft_late"]["p50"] == pytest.approx(0.2)
    assert s["ttft_by_turn"][1]["p99"] == pytest.approx(0.2)
    assert s["tpot"]["p50"] == pytest.approx(0.04)
    assert s["latency"]["p50"] == pytest.approx(0.85)
    assert s["admin_memory"]["waste_pct"] == 3.0


def test_system_without_cache_reporting_has_no_hit_rate():
    s = summarize_system(RESULT["systems"]["hf"])
    assert s["hit_rate"] is None and "ideal_hit_ratio" not in s
    assert s["ideal_hit_rate"] == pytest.approx(0.24)
    assert s["output_tokens_per_s"] == pytest.approx(1.0)


def test_markdown_table_rows():
    table = markdown_table(RESULT)
    ours = next(line for line in table.splitlines() if line.startswith("| ours |"))
    assert "| 200 / 280 / 298 |" in ours  # TTFT turn>=3 p50/p90/p99 in ms
    assert "| 0.40 | 6.0 | 1 (run cut at its deadline, 1 in flight) |" in ours
    cache_rows = [line for line in table.splitlines() if "| 1000 |" in line or "| 400 |" in line]
    assert cache_rows[0] == "| ours | 1000 | 768 | 76.8% | 80.0% | 96.0% | 76.8% | 100.0% |"
    assert cache_rows[1] == "| hf | 400 | – | – | 24.0% | – | – | – |"
    assert "| turn 1 | turn 2 | turn 3 | turn 4 |" in table
    memory = next(line for line in table.splitlines() if line.startswith("| ours | –"))
    assert memory.endswith("| 100 / 120 | 97 | 3.0 % | – |")


def test_plot_writes_a_png(tmp_path):
    path = plot(RESULT, tmp_path / "fig.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
