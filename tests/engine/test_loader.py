"""Loader: the default model's safetensors cache, random shapes, specs, config parsing."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from chatsvc import paths
from chatsvc.engine import weights_gguf
from chatsvc.engine.dtype import resolve_dtype
from chatsvc.engine.loader import load_model
from chatsvc.engine.model_config import ModelConfig
from chatsvc.engine.weights_random import NAMED_CONFIGS, named_config


def test_second_load_of_default_model_reads_the_cached_safetensors(smollm2_fp32, monkeypatch):
    cached = weights_gguf.default_model_dir()
    assert smollm2_fp32.path == cached
    assert weights_gguf.is_converted(cached, weights_gguf.default_gguf_path())

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted again despite a cached directory")

    monkeypatch.setattr(weights_gguf, "_convert", no_conversion)
    again = load_model("smollm2", dtype="fp32", max_positions=64)
    assert again.path == cached
    assert again.name == "SmolLM2-135M-Instruct"
    assert torch.equal(again.model.weights.embed, smollm2_fp32.model.weights.embed)


def test_default_model_shape(smollm2_fp32):
    c = smollm2_fp32.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.hidden_size, c.vocab_size, c.tie_word_embeddings) == (576, 49152, True)
    w = smollm2_fp32.model.weights
    assert w.lm_head is w.embed  # tied: one tensor, not a copy
    assert w.layers[0].qkv_weight.shape == (576 + 2 * 192, 576)
    assert w.layers[0].gate_up_weight.shape == (2 * 1536, 576)
    assert w.embed.dtype == torch.float32


def _fake_convert(gguf, out_dir):
    # Writes what a finished conversion leaves, without de-quantizing anything.
    for name in weights_gguf._REQUIRED_FILES[:-1]:
        (out_dir / name).write_text(out_dir.name)
    (out_dir / weights_gguf.SOURCE_MARKER).write_text(
        weights_gguf.json.dumps(weights_gguf._source_record(gguf))
    )


def test_a_half_written_cache_dir_is_replaced_atomically(tmp_path, monkeypatch):
    models = paths.models_dir(tmp_path)
    target = weights_gguf.default_model_dir(models)
    target.mkdir()
    (target / "config.json").write_text("{}")  # an interrupted old conversion

    monkeypatch.setattr(weights_gguf, "_convert", _fake_convert)
    assert weights_gguf.ensure_default_model(models) == target
    assert weights_gguf.is_converted(target, weights_gguf.default_gguf_path())
    # No staging or stale directories are left beside it.
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_two_converters_at_once_leave_one_complete_directory(tmp_path, monkeypatch):
    models = paths.models_dir(tmp_path)
    both_converting = threading.Barrier(2, timeout=60)

    def convert_together(gguf, out_dir):
        both_converting.wait()  # neither finishes before the other has started
        _fake_convert(gguf, out_dir)

    monkeypatch.setattr(weights_gguf, "_convert", convert_together)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: weights_gguf.ensure_default_model(models), range(2)))
    target = weights_gguf.default_model_dir(models)
    assert results == [target, target]
    assert weights_gguf.is_converted(target, weights_gguf.default_gguf_path())
    # Every file comes from one staging directory: no mix of the two conversions.
    assert len({(target / n).read_text() for n in weights_gguf._REQUIRED_FILES[:-1]}) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_random_named_shape(smollm2_fp32, paged_driver):
    loaded = load_model("random:tiny-llama", dtype="fp32", seed=7)
    raw = NAMED_CONFIGS["tiny-llama"]
    c = loaded.config
    assert loaded.path is None and loaded.name == "random:tiny-llama"
    assert (c.hidden_size, c.num_layers, c.vocab_size) == (64, 2, raw["vocab_size"])
    w = loaded.model.weights
    assert len(w.layers) == 2
    assert w.layers[1].qkv_weight.shape == (c.q_size + 2 * c.kv_size, 64)
    assert w.lm_head.shape == (c.vocab_size, 64) and w.lm_head is not w.embed
    assert len(loaded.tokenizer) >= c.vocab_size  # the default tokenizer decodes its ids

    same = load_model("random:tiny-llama", dtype="fp32", seed=7)
    other = load_model("random:tiny-llama", dtype="fp32", seed=8)
    assert torch.equal(same.model.weights.embed, w.embed)
    assert not torch.equal(other.model.weights.embed, w.embed)
    logits = paged_driver(loaded.model, num_blocks=4, block_size=16).step({"s": [1, 2, 3]})
    assert logits.shape == (1, c.vocab_size) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize(
    "name,layers,kv_heads,bias,scaling",
    [
        ("llama-3-8b", 32, 8, False, None),
        ("llama-3.2-1b", 16, 8, False, "llama3"),
        ("qwen2.5-0.5b", 24, 2, True, None),
        ("smollm2-135m", 30, 3, False, None),
    ],
)
def test_named_configs_parse_without_allocating(name, layers, kv_heads, bias, scaling):
    c = named_config(name)
    assert (c.num_layers, c.num_kv_heads, c.attention_bias) == (layers, kv_heads, bias)
    assert (c.rope_scaling.rope_type if c.rope_scaling else None) == scaling


def test_bad_specs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model spec"):
        load_model("no-such-model-anywhere")
    with pytest.raises(ValueError, match="unknown model shape"):
        load_model("random:gpt-5")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


BASE = dict(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    vocab_size=100,
)


def test_config_parsing_both_rope_spellings():
    legacy = ModelConfig.from_hf_dict(
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}}
    )
    modern = ModelConfig.from_hf_dict(
        {**BASE, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 4.0}}
    )
    assert legacy == modern
    assert legacy.rope_theta == 5e5 and legacy.rope_scaling.factor == 4.0
    assert legacy.num_kv_heads == 4 and legacy.head_dim == 16  # defaults derived
    assert ModelConfig.from_hf_dict({**BASE, "eos_token_id": [5, 7]}).eos_token_ids == (5, 7)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs a 'factor'"),
        ({"model_type": "gpt2"}, "unsupported model_type"),
        ({"num_key_value_heads": 3}, "multiple of"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_config_rejects_what_we_cannot_serve(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**BASE, **change})


def test_dtype_resolution():
    assert resolve_dtype("fp32", "cpu") is torch.float32
    assert resolve_dtype(torch.bfloat16, "cpu") is torch.bfloat16
    assert resolve_dtype(None, "cpu") in (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int4", "cpu")
    with pytest.raises(ValueError):
        resolve_dtype(torch.int64, "cpu")


def test_prepacking_is_refused_where_onednn_cannot_do_it():
    half = load_model("random:tiny-llama", dtype="fp16")
    # fp16 has no packed layout: an invariant model sums in fixed chunks, plain matrices.
    assert not half.model.prepacked and half.model.weight_layout == "chunked"
    fastest = load_model("random:tiny-llama", dtype="fp16", invariant=False)
    assert fastest.model.weight_layout == "plain"
    with pytest.raises(ValueError, match="prepacking"):
        load_model("random:tiny-llama", dtype="fp16", prepack_weights=True, invariant=False)
