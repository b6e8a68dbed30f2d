"""The quality gate of int8 KV (CHATSVC_KV_DTYPE=int8, issue 28): the perplexity of a
public-domain text within 1 % of KV in the model's dtype, and greedy answers that mostly
stay the same. ``python -m bench.kv_quality`` prints the full figures (80 prompts)."""

from __future__ import annotations

from bench.kv_quality import TEXT, common_prefix, first_turns, greedy_answers, perplexity


def test_int8_kv_keeps_perplexity_within_one_percent(smollm2_fp32):
    ids = smollm2_fp32.tokenizer(TEXT.read_text())["input_ids"][:1024]
    floats = perplexity(smollm2_fp32, ids, 512, "auto")
    int8 = perplexity(smollm2_fp32, ids, 512, "int8")
    assert 1 < floats < 200  # the model reads English: a broken forward scores thousands
    assert abs(int8 / floats - 1) <= 0.01, (floats, int8)


def test_int8_kv_mostly_answers_as_the_model_dtype_does(smollm2_fp32):
    prompts = first_turns(8)
    floats = greedy_answers(smollm2_fp32, prompts, 12, "auto")
    int8 = greedy_answers(smollm2_fp32, prompts, 12, "int8")
    assert sum(common_prefix(a, b) for a, b in zip(int8, floats, strict=True)) >= 8 * 12 // 2
