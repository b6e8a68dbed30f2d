"""Random weights for named model shapes: benchmarks of large models without a download.

The outputs are meaningless; shapes, dtypes and the work per step are the real ones.
"""

from __future__ import annotations

from typing import Any

import torch

from chatsvc.engine.model_config import ModelConfig
from chatsvc.engine.weights import ModelWeights, build_weights

# Hugging Face config dicts, so the same parser reads them as a real checkpoint.
NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "bos_token_id": 128000,
        "eos_token_id": 128009,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    # Small enough for tests; the default tokenizer's vocabulary so its text decodes.
    "tiny-llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 49152,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def named_config(name: str) -> ModelConfig:
    """The ModelConfig of a built-in shape; ValueError names the known ones."""
    try:
        raw = NAMED_CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown model shape {name!r}; known: {sorted(NAMED_CONFIGS)}") from None
    return ModelConfig.from_hf_dict(raw)


def _shape_of(config: ModelConfig, name: str) -> tuple[int, ...]:
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {
        "q_proj.weight": (config.q_size, hidden),
        "k_proj.weight": (config.kv_size, hidden),
        "v_proj.weight": (config.kv_size, hidden),
        "q_proj.bias": (config.q_size,),
        "k_proj.bias": (config.kv_size,),
        "v_proj.bias": (config.kv_size,),
        "o_proj.weight": (hidden, config.q_size),
        "gate_proj.weight": (inter, hidden),
        "up_proj.weight": (inter, hidden),
        "down_proj.weight": (hidden, inter),
        "layernorm.weight": (hidden,),
        "norm.weight": (hidden,),
        "embed_tokens.weight": (config.vocab_size, hidden),
        "lm_head.weight": (config.vocab_size, hidden),
    }
    for suffix, shape in shapes.items():
        if name.endswith(suffix):
            return shape
    raise KeyError(name)


def random_weights(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    std: float = 0.02,
) -> ModelWeights:
    """Seeded normal(0, std) matrices and unit norm scales; the same seed gives the same model."""
    generator = torch.Generator().manual_seed(seed)

    def get(name: str) -> torch.Tensor:
        shape = _shape_of(config, name)
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        # Drawn per tensor in the target dtype so an 8B shape never holds an fp32 copy.
        return torch.randn(shape, generator=generator, dtype=dtype) * std

    return build_weights(config, get, dtype, device)
