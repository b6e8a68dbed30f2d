"""The disk-tier benchmarks run end to end on tiny configs and print their figures.

No timing assertions: only that every run finished and the figures hang together.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--max-tokens", "4", "--question-words", "8", "--system-repeat", "1", "--threads", "1"]


def run_bench(module: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_warm_restart_short_shape_presets_flags_and_yields_to_the_command_line():
    from bench.kv_disk.warm_restart import parse_args

    long, short = parse_args([]), parse_args(["--shape", "short", "--sessions", "8"])
    assert long.preload == "both" and parse_args(["--preload", "on"]).preload == "on"
    assert (long.turns, long.min_history, long.max_history) == (4, 1000, None)
    assert (short.turns, short.min_history, short.max_history) == (2, 200, 400)
    assert short.sessions == 8 and short.min_tokens == short.max_tokens == 48
    assert parse_args(["--turns", "3", "--shape", "short"]).turns == 3  # the flag wins


def test_load_bandwidth_reads_back_every_block_exactly(tmp_path):
    out = run_bench("bench.kv_disk.load_bandwidth", "--blocks", "16", "--dir", str(tmp_path))
    assert "(16/16 verified, data exact)" in out
    assert re.search(r"tier load / sequential read: \d+%", out)


@pytest.mark.slow
def test_warm_restart_turn_comes_from_disk(tmp_path):
    out = run_bench(
        "bench.kv_disk.warm_restart",
        *TINY,
        "--sessions", "2", "--turns", "1", "--min-history", "1", "--kv-dir", str(tmp_path),
        "--warm-up-s", "0.2",  # a shape or two: the engines' warm-up is tested elsewhere
    )  # fmt: skip
    runs = ("(a) no restart", "(b) restart, disk tier off", "(c) restart, disk tier on")
    for run in (*runs, "(d) restart, preloaded"):
        assert out.count(run) == 2  # the requests at once, then one at a time
    assert "all sessions at once" in out and "one at a time" in out
    disks = re.findall(r"'disk': (\d+)", out)
    assert len(disks) == 4 and all(int(d) > 0 for d in disks)  # each restart hit its files
    # (d)'s turn came once the preload had read every planned block, and used them.
    preloads = re.findall(r"preload (\d+) of (\d+) blocks in [\d.]+s, (\d+) used", out)
    assert len(preloads) == 2
    assert all(read == planned and int(used) > 0 for read, planned, used in preloads)


@pytest.mark.slow
def test_working_set_reports_each_run(tmp_path):
    out = run_bench(
        "bench.kv_disk.working_set",
        *TINY,
        "--sessions", "3", "--turns", "2", "--think-time", "0.1", "--kv-dir", str(tmp_path),
    )  # fmt: skip
    for run in ("disk on:", "disk off:", "all memory:"):
        assert run in out
    assert re.search(r"hit rate [\d.]+% of ideal", out)


@pytest.mark.slow
def test_kv_capacity_gives_int8_about_twice_the_blocks_of_the_same_bytes():
    out = run_bench(
        "bench.kv_capacity",
        *TINY,
        "--sessions", "2", "--turns", "2", "--think-time", "0", "--pool-fraction", "2",
    )  # fmt: skip
    rows = {
        m[1]: (int(m[2]), float(m[3]))
        for m in re.finditer(r"^\| (auto|int8) \(\w+\) \| (\d+) \|.*?\| ([\d.]+)% \|", out, re.M)
    }
    assert set(rows) == {"auto", "int8"}, out
    assert rows["int8"][0] >= 1.9 * rows["auto"][0]  # the same bytes, 1.94x for SmolLM2
    assert rows["int8"][1] > 0 and rows["auto"][1] > 0  # the second turns hit their first


def test_warm_restart_repeats_print_each_ratio_and_their_median(capsys):
    from bench.kv_disk.warm_restart import parse_args, print_repeats

    assert parse_args([]).repeat == 1 and parse_args(["--repeat", "3"]).repeat == 3
    rows = {}
    for r, (a, c) in enumerate([(0.10, 0.12), (0.10, 0.15), (0.20, 0.20)]):
        for paced in (False, True):
            rows["a", paced, r] = [{"ttft": a}, {"ttft": a}]
            rows["c", paced, r] = [{"ttft": c * 2}, {"ttft": c}]  # the first one slower
    print_repeats(rows, (False, True), 3)
    out = capsys.readouterr().out
    assert "(c)/(a) p50, all sessions at once, 3 repeats: 1.80x, 2.25x, 1.50x; median 1.80x" in out
    first = "(c) first request after each restart / (a) p50: 2.40x, 3.00x, 2.00x; median 2.40x"
    assert first in out
