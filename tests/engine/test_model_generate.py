"""A greedy loop over our forward pass alone is token-identical to transformers' generate."""

from __future__ import annotations

import pytest
import torch

CASES = [
    ([{"role": "user", "content": "What is the capital of France?"}], 32),
    ([{"role": "user", "content": "Name three colors."}], 24),
    (
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Say hello in Spanish."},
        ],
        16,
    ),
]


@pytest.fixture(params=["native", "torch"], autouse=True)
def kernel_backend(request, monkeypatch):
    """Every test here runs on both CPU paths: the native C kernels and the torch reference."""
    monkeypatch.setenv("CHATSVC_KERNEL_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("messages,max_new", CASES)
def test_greedy_matches_transformers_generate(
    smollm2_fp32, smollm2_hf_fp32, paged_driver, messages, max_new
):
    from chatsvc.engine.chat_format import ChatFormat

    chat = ChatFormat(smollm2_fp32.tokenizer, smollm2_fp32.config.eos_token_ids)
    prompt = chat.render(messages)

    with torch.inference_mode():
        reference = smollm2_hf_fp32.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=list(chat.stop_token_ids),
            pad_token_id=chat.stop_token_ids[0],
        )[0, len(prompt) :].tolist()

    driver = paged_driver(smollm2_fp32.model, block_size=16, seed=4)
    ours: list[int] = []
    logits = driver.step({"s": prompt})
    while len(ours) < max_new:
        token = int(logits[0].argmax())
        ours.append(token)
        if token in chat.stop_token_ids:
            break
        logits = driver.step({"s": [token]})
    assert ours == reference
    assert len(ours) >= 4  # the model really generated text, not an immediate stop
