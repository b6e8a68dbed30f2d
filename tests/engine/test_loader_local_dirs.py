"""Tiny random Hugging Face checkpoints (Llama with rope scaling, Qwen2, Mistral) load
through the local-directory path and match transformers' logits."""

from __future__ import annotations

import pytest
import torch
import transformers

from chatsvc.engine.loader import load_model

SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=512,
    max_position_embeddings=256,
)

CONFIGS = {
    "llama3-scaling": lambda: transformers.LlamaConfig(
        **SHAPE,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Small, so the scaled band covers many of head_dim 16's frequencies.
            "original_max_position_embeddings": 32,
        },
    ),
    "llama-linear-tied": lambda: transformers.LlamaConfig(
        **SHAPE, rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True
    ),
    "qwen2-bias": lambda: transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**SHAPE),
}


@pytest.fixture(scope="module")
def default_tokenizer(smollm2_fp32):
    return smollm2_fp32.tokenizer


@pytest.mark.parametrize("prepack", [True, False], ids=["prepacked", "plain"])
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_local_dir_matches_transformers(kind, prepack, tmp_path, default_tokenizer, paged_driver):
    torch.manual_seed(0)
    config = CONFIGS[kind]()
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    # Biases start at zero; make them matter so a dropped bias fails the test.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    assert (kind == "qwen2-bias") == any(n.endswith("bias") for n, _ in hf.named_parameters())
    # Small shards: the sharded path (index.json) is exercised too.
    hf.save_pretrained(tmp_path, max_shard_size="200KB")
    default_tokenizer.save_pretrained(tmp_path)

    loaded = load_model(str(tmp_path), dtype="fp32", prepack_weights=prepack)
    assert loaded.path == tmp_path and loaded.model.prepacked == prepack
    assert loaded.config.attention_bias == (kind == "qwen2-bias")
    if kind == "llama3-scaling":
        assert loaded.config.rope_scaling.rope_type == "llama3"

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (40,), generator=gen).tolist()
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    driver = paged_driver(loaded.model, num_blocks=16, block_size=8, seed=5)
    got = [driver.step({"s": tokens[:30]})[0]]
    got += [driver.step({"s": [t]})[0] for t in tokens[30:]]
    torch.testing.assert_close(torch.stack(got), expected[29:], atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_with_missing_tensor_fails_clearly(tmp_path, default_tokenizer):
    from safetensors.torch import load_file, save_file

    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SHAPE))
    hf.save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj"):
        load_model(str(tmp_path), dtype="fp32")


def test_generation_config_eos_ids_are_merged(tmp_path, default_tokenizer):
    config = transformers.LlamaConfig(**SHAPE, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7, 9]}')
    loaded = load_model(str(tmp_path), dtype="fp32")
    assert loaded.config.eos_token_ids == (2, 7, 9)
