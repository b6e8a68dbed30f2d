"""The model's tensors in serving form: fused projections, one dtype, one device.

Checkpoints store q/k/v and gate/up as separate matrices; we concatenate them once
at load so each layer runs one QKV matmul and one gate-up matmul per step:

    qkv_weight     [q_size + 2 * kv_size, hidden]   rows: q | k | v
    gate_up_weight [2 * intermediate, hidden]        rows: gate | up
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from chatsvc.engine.model_config import ModelConfig

TensorGetter = Callable[[str], torch.Tensor]


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv_weight: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o_weight: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up_weight: torch.Tensor  # [2 * intermediate, hidden]
    down_weight: torch.Tensor  # [hidden, intermediate]


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


def _expect(tensor: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, checkpoint has {tuple(tensor.shape)}")
    return tensor


def build_weights(
    config: ModelConfig, get: TensorGetter, dtype: torch.dtype, device: torch.device | str
) -> ModelWeights:
    """Assemble serving weights from Hugging Face tensor names (``model.layers.0...``).

    ``get(name)`` returns a checkpoint tensor and raises KeyError when it is missing.
    """
    hidden, q, kv, inter = (
        config.hidden_size,
        config.q_size,
        config.kv_size,
        config.intermediate_size,
    )

    def load(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        try:
            tensor = get(name)
        except KeyError:
            raise ValueError(f"checkpoint is missing tensor {name!r}") from None
        return _expect(tensor, shape, name).to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat(
            [
                load(p + "self_attn.q_proj.weight", (q, hidden)),
                load(p + "self_attn.k_proj.weight", (kv, hidden)),
                load(p + "self_attn.v_proj.weight", (kv, hidden)),
            ]
        )
        bias = None
        if config.attention_bias:
            bias = torch.cat(
                [
                    load(p + "self_attn.q_proj.bias", (q,)),
                    load(p + "self_attn.k_proj.bias", (kv,)),
                    load(p + "self_attn.v_proj.bias", (kv,)),
                ]
            )
        gate_up = torch.cat(
            [
                load(p + "mlp.gate_proj.weight", (inter, hidden)),
                load(p + "mlp.up_proj.weight", (inter, hidden)),
            ]
        )
        layers.append(
            LayerWeights(
                input_norm=load(p + "input_layernorm.weight", (hidden,)),
                qkv_weight=qkv,
                qkv_bias=bias,
                o_weight=load(p + "self_attn.o_proj.weight", (hidden, q)),
                post_norm=load(p + "post_attention_layernorm.weight", (hidden,)),
                gate_up_weight=gate_up,
                down_weight=load(p + "mlp.down_proj.weight", (hidden, inter)),
            )
        )
    embed = load("model.embed_tokens.weight", (config.vocab_size, hidden))
    if config.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = load("lm_head.weight", (config.vocab_size, hidden))
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=load("model.norm.weight", (hidden,)),
        lm_head=lm_head,
    )


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: from the shard index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


@contextmanager
def open_safetensors(model_dir: Path) -> Iterator[TensorGetter]:
    """A getter over every shard of a checkpoint; tensors are memory-mapped, read on demand."""
    with ExitStack() as stack:
        where: dict[str, object] = {}
        for path in safetensors_files(model_dir):
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            for name in handle.keys():
                where[name] = handle

        def get(name: str) -> torch.Tensor:
            return where[name].get_tensor(name)  # KeyError when absent

        yield get
