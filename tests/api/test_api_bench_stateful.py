"""The stateful-API benchmarks end to end on a tiny config, against the live test server.

No timing assertions: only that every request succeeded and the figures hang together.
"""

from __future__ import annotations

import json

from bench.stateful.__main__ import main as stateful_main
from bench.stateful.regenerate import main as regenerate_main
from tests.api.conftest import ACME_KEY, BLOCK_SIZE


def _run(main, api, tmp_path) -> dict:
    assert main(["--smoke", "--url", api.url, "--api-key", ACME_KEY, "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    return json.loads(path.read_text())


def test_responses_against_chat_completions(api, tmp_path):
    result = _run(stateful_main, api, tmp_path)
    for api_name in ("responses", "chat"):
        records = result["raw"][api_name]["records"]
        assert len(records) == 4
        assert all(r["ttft_s"] is not None and r["completion_tokens"] >= 1 for r in records)
    turns = result["per_turn"]
    # The second turn: the Responses API sends the new message only, chat the whole history.
    assert turns["responses"]["1"]["bytes_sent"] < turns["chat"]["1"]["bytes_sent"]
    assert turns["responses"]["1"]["hit_rate"] > 0
    assert (tmp_path / next(p.name for p in tmp_path.glob("stateful-*.md"))).read_text()


def test_regenerate_against_the_original_turn(api, tmp_path):
    result = _run(regenerate_main, api, tmp_path)
    for original, again in zip(result["original"], result["regenerate"], strict=True):
        prompt = original["usage"]["prompt_tokens"]
        assert again["usage"]["prompt_tokens"] == prompt
        assert again["usage"]["cached_tokens"] >= (prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert len(result["edit"]) == 2
