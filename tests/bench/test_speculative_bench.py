"""bench.speculative on tiny sizes: every workload runs with speculation on and off and
the greedy outputs agree. No timing assertion (docs/benchmarks.md has the figures)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_rewrite_set_ships_30_or_more_pairs():
    lines = (REPO / "bench" / "data" / "rewrite_turns.jsonl").read_text().splitlines()
    pairs = [json.loads(line) for line in lines]
    assert len(pairs) >= 30
    assert all(p["first"].strip() and p["second"].strip() for p in pairs)
    assert {p["kind"] for p in pairs} == {"code", "text"}


@pytest.mark.slow
def test_a_tiny_run_prints_every_workload_on_and_off():
    result = subprocess.run(
        [sys.executable, "-m", "bench.speculative", "--rewrites", "2", "--chats", "2",
         "--batches", "2", "--max-tokens", "8", "--first-tokens", "8", "--dtype", "fp32"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for tag in ("rewrite-b2", "chat-b2", "fresh-b2"):
        assert f"  {tag}: batch 2, 2 prompts" in out
    assert len(re.findall(r"^\s+off\s+[\d.]+ decode tokens/s$", out, re.M)) == 3
    assert len(re.findall(r"acceptance [\d.]+ \(\d+/\d+\)\s+identical to off 2/2$", out, re.M)) == 3
