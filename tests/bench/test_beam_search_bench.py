"""bench.beam_search on tiny sizes: every variant runs and the figures hang together.

No timing assertion (timings belong to the benchmark's full run, docs/benchmarks.md);
the blocks are not timings: the search's peak stays within the bound and below the
independent requests'.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_tiny_run_prints_every_variant_and_the_memory_bound_holds():
    result = subprocess.run(
        [sys.executable, "-m", "bench.beam_search", "--width", "2", "--prompt-tokens", "64",
         "--answer-tokens", "4", "--rounds", "1", "--dtype", "fp32"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    rows = dict(
        re.findall(r"^(beams|independent|greedy|transformers)\s+[\d.]+\s+(\S+)\s+\S+$", out, re.M)
    )
    assert set(rows) == {"beams", "independent", "greedy", "transformers"}
    assert int(rows["beams"]) < int(rows["independent"])
    assert re.search(r"^met    beams peak \d+ blocks <= bound \d+", out, re.M)
    assert re.search(r"beams / greedy time [\d.]+x", out)
    assert re.search(r"transformers / beams time [\d.]+x", out)
