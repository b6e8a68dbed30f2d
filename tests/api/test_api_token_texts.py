"""Per-token text and bytes for logprobs (chatsvc.api.openai.token_texts), on the served
model's tokenizer."""

from __future__ import annotations

from chatsvc.api.openai.token_texts import TokenTexts


def test_token_bytes_are_exact_even_for_part_of_a_character(api):
    tokenizer = api.services.engine.tokenizer
    texts = TokenTexts(tokenizer)
    text = "Tokyo is 東京 — ünïcode <|im_end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert b"".join(bytes(texts.bytes(i)) for i in ids).decode() == text
    assert any("\ufffd" in texts.text(i) for i in ids)  # a CJK character split in two
    assert texts.text(tokenizer.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"
