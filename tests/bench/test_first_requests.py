"""bench.first_requests: its prompts share no cacheable prefix, and a run prints its figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.first_requests import prompt_messages

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16  # the engine's default block size: a prefix hit needs a whole shared block


def test_prompts_are_one_shape_and_share_under_a_block(tokenizer):
    texts = [
        tokenizer.apply_chat_template(
            prompt_messages(i, 300), add_generation_prompt=True, tokenize=False
        )
        for i in range(10)
    ]
    rendered = [tokenizer.encode(text) for text in texts]
    lengths = [len(ids) for ids in rendered]
    assert max(lengths) - min(lengths) <= 20 and 280 <= min(lengths) <= 360
    for i, a in enumerate(rendered):
        for b in rendered[i + 1 :]:
            shared = next(n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            assert shared < BLOCK
    assert prompt_messages(3, 300) == prompt_messages(3, 300)  # the same run twice


@pytest.mark.slow
def test_a_fresh_start_reports_every_request():
    result = subprocess.run(
        [sys.executable, "-m", "bench.first_requests", "--requests", "2", "--prompt-words", "20",
         "--max-tokens", "2", "--threads", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"/readyz 200 after [\d.]+s", result.stdout)
    rows = re.findall(r"^\s+\d+\s+[\d.]+\s+[\d.]+\s+(\d+)\s+(\d+)\s+\d+$", result.stdout, re.M)
    assert len(rows) == 2 and all(cached == "0" for _, cached in rows)
    assert re.search(r"first/last \(2th\) TTFT = [\d.]+x", result.stdout)
    assert re.search(r"stop on SIGTERM took [\d.]+s", result.stdout)
