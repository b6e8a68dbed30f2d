"""The layers in one native call (kernels.cpu.decoder): a model whose matrices are in a
native linear's layout (an fp32 model over narrow blocks, a bf16 model over dot pairs
or tiles) runs its whole layer loop in ``chatsvc_decoder_layers``, and every logit and
every KV byte it writes are the bits of the model's own loop, one kernel call at a time."""

from __future__ import annotations

import platform

import pytest
import torch

from chatsvc.engine.llama import LlamaModel
from chatsvc.engine.loader import load_model
from chatsvc.engine.model_config import ModelConfig
from chatsvc.engine.weights_random import random_weights
from kernels.backend import narrow_linears_available
from kernels.cpu import decoder
from kernels.cpu.decoder import LayerWeights, decoder_weights

pytestmark = pytest.mark.skipif(
    not narrow_linears_available("cpu", torch.float32) and platform.machine() != "x86_64",
    reason="the narrow-block linears are written for x86's AVX2",
)


def _turns(seed: int) -> list[dict[str, list[int]]]:
    """A prefill of two prompts, a step with a decode beside a three-token extend, and
    two decodes: every kind of row the engine's steps hold."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(100, 20000, (n,), generator=g).tolist()

    return [{"a": ids(37), "b": ids(5)}, {"a": ids(1), "b": ids(3)}, {"a": ids(1), "b": ids(1)}]


def _run_both(model: LlamaModel, paged_driver, monkeypatch, kv_dtype, seed=0):
    """Logits and pool of the same turns with the one call and with the loop, and how many
    times the one call ran in each."""
    calls = []
    real_run = decoder.run
    monkeypatch.setattr(decoder, "run", lambda lib, step: (calls.append(1), real_run(lib, step)))
    saved = model.native_layers
    results = {}
    try:
        for one_call in (True, False):
            model.native_layers = saved if one_call else None
            calls.clear()
            driver = paged_driver(model, num_blocks=16, kv_dtype=kv_dtype)
            logits = [driver.step(turn) for turn in _turns(seed)]
            results[one_call] = (logits, driver.pool, len(calls))
    finally:
        model.native_layers = saved
    return results[True], results[False]


MODELS = {  # dtype, stored weights
    "fp32-int8-blocks": ("fp32", "int8"),
    "fp32-bf16-blocks": ("fp32", "bf16"),
    "fp32-fp32-blocks": ("fp32", "fp32"),
    "bf16": ("bf16", None),  # dot pairs (AVX512-BF16), tiles (AMX) or, on AVX2, bf16 blocks
}


@pytest.fixture(scope="module", params=list(MODELS))
def native_model(request) -> LlamaModel:
    dtype, weight_dtype = MODELS[request.param]
    return load_model("smollm2", dtype=dtype, weight_dtype=weight_dtype).model


@pytest.mark.parametrize(
    "kv_dtype", [None, torch.bfloat16, torch.int8], ids=["kv-model-dtype", "kv-bf16", "kv-int8"]
)
def test_the_layers_in_one_call_write_and_answer_the_loops_bits(
    native_model, kv_dtype, paged_driver, monkeypatch
):
    if native_model.dtype == torch.bfloat16 and native_model.weight_layout == "bf16_blocks":
        # A bf16 model over narrow blocks widens its rows to fp32 per linear: the loop.
        assert native_model.native_layers is None
        return
    assert native_model.weight_layout in (
        "int8_blocks",
        "bf16_blocks",
        "fp32_blocks",
        "pair_blocks",
        "tiles",
    )
    assert native_model.native_layers is not None
    one_call, loop = _run_both(native_model, paged_driver, monkeypatch, kv_dtype)
    assert (one_call[2], loop[2]) == (3, 0)  # every step took the one call; the loop none
    for got, want in zip(one_call[0], loop[0], strict=True):
        assert torch.equal(got, want)
    assert torch.equal(one_call[1], loop[1])  # K, V and an int8 pool's scales


@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [(torch.float32, "int8"), (torch.bfloat16, None)],
    ids=["fp32-int8", "bf16"],
)
def test_a_qkv_bias_reaches_the_one_call(dtype, weight_dtype, paged_driver, monkeypatch):
    # Qwen2's projections carry a bias: a small model of its shape, random weights.
    config = ModelConfig.from_hf_dict(
        {
            "model_type": "qwen2",
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 256,
            "vocab_size": 20480,
            "max_position_embeddings": 512,
        }
    )

    def model(bias: bool) -> LlamaModel:
        weights = random_weights(config, dtype, "cpu", seed=3)
        gen = torch.Generator().manual_seed(4)
        for layer in weights.layers:
            noise = torch.randn(layer.qkv_bias.shape, generator=gen) * (0.5 if bias else 0.0)
            layer.qkv_bias.copy_(noise)
        return LlamaModel(config, weights, weight_dtype=weight_dtype)

    if dtype == torch.bfloat16 and model(True).weight_layout == "bf16_blocks":
        assert model(True).native_layers is None  # an AVX2 CPU's bf16 model: the loop
        return
    one_call, loop = _run_both(model(True), paged_driver, monkeypatch, None, seed=1)
    assert (one_call[2], loop[2]) == (3, 0)
    for got, want in zip(one_call[0], loop[0], strict=True):
        assert torch.equal(got, want)
    # The bias counts: the same model without it answers otherwise.
    without, _ = _run_both(model(False), paged_driver, monkeypatch, None, seed=1)
    assert not torch.equal(without[0][0], one_call[0][0])


def test_only_matrices_of_one_native_kind_in_their_dtype_take_the_one_call():
    hidden, inter, qkv = 64, 128, 128
    norm = torch.ones(hidden)

    def layer(matrix) -> LayerWeights:
        return LayerWeights(
            norm,
            norm,
            matrix(torch.randn(qkv, hidden)),
            None,
            matrix(torch.randn(hidden, hidden)),
            matrix(torch.randn(2 * inter, hidden)),
            matrix(torch.randn(hidden, inter)),
        )

    from kernels.cpu.narrow_linear import pack_bf16_weight, pack_int8_weight

    packed = decoder_weights([layer(pack_int8_weight)] * 2)
    assert packed is not None and packed.num_layers == 2
    assert (packed.hidden, packed.intermediate, packed.qkv_rows) == (hidden, inter, qkv)
    assert decoder_weights([layer(lambda m: m)]) is None  # plain matrices: the loop
    bf16_norms = layer(pack_int8_weight)._replace(input_norm=norm.bfloat16())
    assert decoder_weights([bf16_norms]) is None
    wrong_down = layer(pack_int8_weight)._replace(down=pack_int8_weight(torch.randn(64, 64)))
    assert decoder_weights([wrong_down]) is None
    mixed = layer(pack_int8_weight)._replace(o=pack_bf16_weight(torch.randn(hidden, hidden)))
    assert decoder_weights([mixed]) is not None  # narrow blocks of two formats: one kind
    # A model whose matrices stay plain (torch's own matmuls) has none.
    plain = load_model("random:smollm2-135m", dtype="fp32", prepack_weights=False).model
    assert plain.weight_layout == "plain" and plain.native_layers is None
