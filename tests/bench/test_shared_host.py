"""bench.shared_host: a run prints its quiet and busy figures and leaves no neighbour."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_run_reports_quiet_and_busy_and_kills_its_neighbour():
    result = subprocess.run(
        [sys.executable, "-m", "bench.shared_host", "--conversations", "1", "--turns", "2",
         "--in-flight", "1", "--max-tokens", "2", "--rounds", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for kind in ("quiet", "busy"):
        assert re.search(rf"median {kind}\s+ttft_p50_ms\s+\d+\.\d", result.stdout), result.stdout
    assert re.search(r"busy/quiet: ttft \d+\.\d\dx", result.stdout), result.stdout
    # The neighbour's busy loop ended with the run.
    loops = subprocess.run(["pgrep", "-f", "shared-host neighbour"], capture_output=True, text=True)
    assert loops.stdout.strip() == "", loops.stdout
