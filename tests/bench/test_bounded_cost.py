"""The bounded-cost fuzz end to end on its smoke config: a real service, both tenants.

Checked: the witness's answer under the attack is the one it got alone, and no
attacker request got a 5xx. Not checked: the gap bound (a timing figure).
"""

from __future__ import annotations

import asyncio

import pytest

from bench.reliability.bounded_cost import parse_args, run, summary


@pytest.mark.slow
def test_smoke_run_leaves_the_witness_answer_unchanged(tmp_path):
    args = parse_args(["--smoke"])
    solo, rows = asyncio.run(run(args, tmp_path))
    (row,) = rows
    assert solo.answers and all(solo.answers) and not solo.problems
    assert row.witness.answers == solo.answers and not row.witness.problems
    assert sum(row.statuses.values()) >= 1
    assert not row.attacker_problems and all(status < 500 for status in row.statuses)
    table, ok = summary(solo, rows, args.max_gap_s)
    assert ok and row.endpoint in table
