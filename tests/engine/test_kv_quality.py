"""The quality gate of a narrower KV (CHATSVC_KV_DTYPE=int8, issue 28; =bf16 under an
fp32 model): the perplexity of a public-domain text within 1 % of KV in the model's dtype,
and greedy answers that mostly stay the same. ``python -m bench.kv_quality`` prints the
full figures (80 prompts)."""

from __future__ import annotations

import pytest

from bench.kv_quality import TEXT, common_prefix, first_turns, greedy_answers, perplexity


@pytest.mark.parametrize("kv_dtype", ["int8", "bf16"])
def test_narrower_kv_keeps_perplexity_within_one_percent(smollm2_fp32, kv_dtype):
    ids = smollm2_fp32.tokenizer(TEXT.read_text())["input_ids"][:1024]
    floats = perplexity(smollm2_fp32, ids, 512, "auto")
    narrow = perplexity(smollm2_fp32, ids, 512, kv_dtype)
    assert 1 < floats < 200  # the model reads English: a broken forward scores thousands
    assert abs(narrow / floats - 1) <= 0.01, (floats, narrow)


@pytest.mark.parametrize("kv_dtype", ["int8", "bf16"])
def test_narrower_kv_mostly_answers_as_the_model_dtype_does(smollm2_fp32, kv_dtype):
    prompts = first_turns(8)
    floats = greedy_answers(smollm2_fp32, prompts, 12, "auto")
    narrow = greedy_answers(smollm2_fp32, prompts, 12, kv_dtype)
    assert sum(common_prefix(a, b) for a, b in zip(narrow, floats, strict=True)) >= 8 * 12 // 2
