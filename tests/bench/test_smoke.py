"""The whole harness end to end on a tiny config: start real servers, run, write figures.

No timing assertions: only that every request succeeded and the figures hang together.
"""

from __future__ import annotations

import json

import pytest

from bench.multiturn.__main__ import main


@pytest.mark.slow
@pytest.mark.parametrize("system", ["ours", "hf"])
def test_smoke_run(system, model_dir, tmp_path):
    out = tmp_path / "results"
    assert (
        main(["--smoke", "--systems", system, "--model-dir", str(model_dir), "--out", str(out)])
        == 0
    )
    (path,) = out.glob("multiturn-*.json")
    result = json.loads(path.read_text())
    entry = result["systems"][system]
    records = entry["records"]
    assert len(records) == 4 and all(r["error"] is None for r in records)
    assert all(r["completion_tokens"] >= 1 and r["answer"] for r in records)
    # Turn 2 resends turn 1 and its answer, so its prompt is longer.
    by_conv = {}
    for r in records:
        by_conv.setdefault(r["conversation_id"], {})[r["turn"]] = r["prompt_tokens"]
    assert all(turns[1] > turns[0] for turns in by_conv.values())
    # The ideal of the trace: both conversations share the 40-token system prompt.
    assert 0 < entry["ideal"]["cached_tokens"] < entry["ideal"]["prompt_tokens"]
    if system == "ours":
        assert all(r["cached_tokens"] is not None for r in records)
        assert sum(r["cached_tokens"] for r in records) > 0
        assert entry["admin_samples"], "GET /admin/cache was never sampled"
    assert list(out.glob("multiturn-*.png")) and list(out.glob("multiturn-*.md"))
