"""The quality gate of int8 weights (CHATSVC_WEIGHT_DTYPE=int8, issue 27): the
perplexity of a public-domain text within 1 % of the bf16 weights' (the checkpoint's
own values), and answers that mostly stay the same. ``python -m bench.weight_quality``
prints the full figures."""

from __future__ import annotations

import pytest
import torch

from bench.weight_quality import PROMPTS, TEXT, greedy, perplexity
from chatsvc.engine.loader import load_model
from kernels.backend import narrow_linears_available
from tests.components import missing_component


@pytest.fixture(scope="module")
def int8_model():
    if not narrow_linears_available("cpu", torch.float32):
        missing_component("int8 weights run on the native kernels' AVX2 path (x86, gcc)")
    return load_model("smollm2", dtype="fp32", weight_dtype="int8")


def test_int8_weights_keep_perplexity_within_one_percent_of_bf16(smollm2_fp32, int8_model):
    assert smollm2_fp32.model.weight_layout == "bf16_blocks"
    assert int8_model.model.weight_layout == "int8_blocks"
    ids = smollm2_fp32.tokenizer(TEXT.read_text())["input_ids"][:1024]
    bf16 = perplexity(smollm2_fp32, ids, 512)
    int8 = perplexity(int8_model, ids, 512)
    assert 1 < bf16 < 200  # the model reads English: a broken forward scores thousands
    assert int8 / bf16 <= 1.01, (bf16, int8)


def test_int8_weights_mostly_answer_as_bf16_does(smollm2_fp32, int8_model):
    prompts = PROMPTS[:4]
    same = sum(greedy(int8_model, p, 12) == greedy(smollm2_fp32, p, 12) for p in prompts)
    assert same >= 2, same
