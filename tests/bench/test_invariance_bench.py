"""bench.invariance: its chats parse, and a small run compares the cache on and off."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from bench.invariance import TURNS

REPO = Path(__file__).resolve().parents[2]


def test_the_chats_are_eighty_two_turn_conversations():
    chats = [json.loads(line) for line in TURNS.read_text().splitlines() if line.strip()]
    assert len(chats) == 80
    assert all(len(turns) == 2 and all(isinstance(t, str) and t for t in turns) for turns in chats)
    assert len({turns[0] for turns in chats}) == 80


def test_a_small_run_counts_identical_turns():
    result = subprocess.run(
        [sys.executable, "-m", "bench.invariance", "--conversations", "2", "--max-tokens", "4",
         "--modes", "invariant"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    line = re.search(r"invariant: (\d+)/4 turns identical .*: (\d+) cached", result.stdout)
    assert line, result.stdout
    assert int(line.group(1)) == 4 and int(line.group(2)) > 0
