"""kernels.linear: every weight layout's matmuls compute the plain ones, and a
model's prepack_weights maps to the layout the kernels allow here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.backend import (
    ENV_VAR,
    narrow_linears_available,
    pair_linears_available,
    tile_linears_available,
)
from kernels.kv_layout import HUGE_PAGE_BYTES
from kernels.linear import (
    LINEARS,
    WEIGHT_LAYOUTS,
    can_prepack,
    choose_layout,
    columns_pay,
    exact_in_bf16,
)
from tests.memory_maps import vm_flags

CPU = torch.device("cpu")


def _available(dtype):
    narrow = narrow_linears_available(CPU, dtype)
    return [
        layout
        for layout in WEIGHT_LAYOUTS
        if layout in ("plain", "chunked")
        or (layout == "onednn" and can_prepack(CPU, dtype))
        or (layout == "tiles" and tile_linears_available(CPU, dtype))
        or (layout == "pair_blocks" and pair_linears_available(CPU, dtype))
        or (layout == "bf16_blocks" and narrow)
        or (layout == "fp32_blocks" and narrow and dtype == torch.float32)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_layout_computes_the_plain_matmuls(dtype):
    gen = torch.Generator().manual_seed(0)
    # Values bf16 holds, so the bf16_blocks layout (which rounds to bf16) computes them too.
    weight = torch.randn(96, 64, generator=gen).bfloat16().to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    residual = torch.randn(5, 96, generator=gen).to(dtype)
    expected = F.linear(x.float(), weight.float(), bias.float())
    expected_add = residual.float() + x.float() @ weight.float().t()
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 2e-2}
    for layout in _available(dtype):
        linears = LINEARS[layout]
        packed = linears.pack(weight)
        torch.testing.assert_close(linears.linear(x, packed, bias).float(), expected, **tol)
        got = linears.linear_add(x, packed, residual)
        torch.testing.assert_close(got.float(), expected_add, **tol)


def test_prepack_weights_picks_a_layout_the_kernels_allow(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "torch")
    assert not tile_linears_available(CPU, torch.bfloat16)  # tiles need the native backend
    with pytest.raises(ValueError, match="'tiles' weight layout is not available"):
        choose_layout("tiles", CPU, torch.bfloat16)
    assert choose_layout(False, CPU, torch.bfloat16) == "plain"
    # Invariant models (the default) never take torch's own matmuls: chunked without the
    # native linears; the fastest layout only where invariance is given up.
    assert choose_layout(None, CPU, torch.float16) == "chunked"
    assert choose_layout(None, CPU, torch.float16, invariant=False) == "plain"
    with pytest.raises(ValueError, match="needs fp32/bf16"):
        choose_layout(True, CPU, torch.float16, invariant=False)
    with pytest.raises(ValueError, match="one of"):
        choose_layout("blocked", CPU, torch.float32)
    assert choose_layout(None, CPU, torch.bfloat16) == "chunked"
    # On CUDA cuBLAS picks its kernels by the shape: invariant models take the Triton matmul.
    cuda = torch.device("cuda")
    assert choose_layout(None, cuda, torch.bfloat16) == "triton"
    assert choose_layout(None, cuda, torch.bfloat16, invariant=False) == "plain"
    if can_prepack(CPU, torch.bfloat16):
        assert choose_layout(None, CPU, torch.bfloat16, invariant=False) == "onednn"
    monkeypatch.setenv(ENV_VAR, "native")
    if tile_linears_available(CPU, torch.bfloat16):
        assert choose_layout(None, CPU, torch.bfloat16) == "tiles"
        assert choose_layout("onednn", CPU, torch.bfloat16) == "onednn"
    elif pair_linears_available(CPU, torch.bfloat16):  # AVX512-BF16 without a tile unit
        assert choose_layout(None, CPU, torch.bfloat16) == "pair_blocks"
    elif narrow_linears_available(CPU, torch.bfloat16):  # a bf16 model summed in fp32
        assert choose_layout(None, CPU, torch.bfloat16) == "bf16_blocks"


def test_an_fp32_model_reads_bf16_weights_only_where_that_changes_nothing(monkeypatch):
    """bf16_blocks is the fp32 default only for weights exact in bf16 (a bf16 checkpoint);
    other fp32 weights keep fp32 (fp32_blocks; oneDNN's layout when invariance is given
    up) unless the layout is asked for by name."""
    monkeypatch.setenv(ENV_VAR, "native")
    gen = torch.Generator().manual_seed(1)
    exact = torch.randn(8, 8, generator=gen).bfloat16().float()
    inexact = exact + 1e-4
    assert exact_in_bf16([exact, exact.bfloat16()]) and not exact_in_bf16([exact, inexact])
    if not narrow_linears_available(CPU, torch.float32):
        with pytest.raises(ValueError, match="'bf16_blocks' weight layout is not available"):
            choose_layout("bf16_blocks", CPU, torch.float32)
        return
    yes, no = (lambda: True), (lambda: False)
    assert choose_layout(None, CPU, torch.float32, exact_in_bf16=yes) == "bf16_blocks"
    assert choose_layout(True, CPU, torch.float32, exact_in_bf16=yes) == "bf16_blocks"
    fallback = "onednn" if can_prepack(CPU, torch.float32) else "plain"
    assert choose_layout(None, CPU, torch.float32, exact_in_bf16=no) == "fp32_blocks"
    assert choose_layout(None, CPU, torch.float32, None, no, invariant=False) == fallback
    assert choose_layout("bf16_blocks", CPU, torch.float32) == "bf16_blocks"
    monkeypatch.setenv(ENV_VAR, "torch")
    assert choose_layout(None, CPU, torch.float32, exact_in_bf16=yes) == "chunked"
    assert choose_layout(None, CPU, torch.float32, None, yes, invariant=False) == fallback


def test_the_weight_dtype_setting_reaches_the_layout(monkeypatch):
    from chatsvc.engine import config as engine_config
    from kernels.linear import WEIGHT_DTYPES

    assert engine_config.WEIGHT_DTYPES == WEIGHT_DTYPES
    with pytest.raises(ValueError, match="CHATSVC_WEIGHT_DTYPE|weight_dtype must be one of"):
        engine_config.EngineConfig.from_env({"CHATSVC_WEIGHT_DTYPE": "int4"})
    assert (
        engine_config.EngineConfig.from_env({"CHATSVC_WEIGHT_DTYPE": "fp32"}).weight_dtype == "fp32"
    )
    monkeypatch.setenv(ENV_VAR, "native")
    with pytest.raises(ValueError, match="fp32 weights run in an fp32 model"):
        choose_layout(None, CPU, torch.bfloat16, "fp32")
    exact = lambda: True  # noqa: E731
    fallback = "onednn" if can_prepack(CPU, torch.float32) else "plain"
    assert choose_layout(None, CPU, torch.float32, "fp32", exact, invariant=False) == fallback
    if narrow_linears_available(CPU, torch.float32):
        assert choose_layout(None, CPU, torch.float32, "fp32", exact) == "fp32_blocks"
    with pytest.raises(ValueError, match="stores bf16 weights"):
        choose_layout("bf16_blocks", CPU, torch.float32, "fp32")
    with pytest.raises(ValueError, match="bf16 weights in an fp32 model are bf16_blocks"):
        choose_layout("onednn", CPU, torch.float32, "bf16")
    with pytest.raises(ValueError, match="int8 weights in an fp32 model are int8_blocks"):
        choose_layout("bf16_blocks", CPU, torch.float32, "int8")
    with pytest.raises(ValueError, match="int8 weights run in an fp32 model"):
        choose_layout(None, CPU, torch.bfloat16, "int8")
    if narrow_linears_available(CPU, torch.float32):
        assert choose_layout(None, CPU, torch.float32, "bf16") == "bf16_blocks"  # rounds
        assert choose_layout(None, CPU, torch.float32, "int8") == "int8_blocks"
        assert choose_layout(None, CPU, torch.float32, "auto", exact) == "bf16_blocks"
    assert choose_layout(None, CPU, torch.bfloat16, "bf16") == choose_layout(
        None, CPU, torch.bfloat16
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_layout_sums_a_row_the_same_whatever_the_step(dtype):
    """torch's own matmuls do not (one row takes a matrix-vector path); chunked calls
    every matmul at one shape."""
    gen = torch.Generator().manual_seed(2)
    linears = LINEARS["chunked"]
    weight = linears.pack((torch.randn(300, 576, generator=gen) / 24).to(dtype))
    x = torch.randn(40, 576, generator=gen).to(dtype)
    residual = torch.randn(40, 300, generator=gen).to(dtype)
    batch = linears.linear_add(x, weight, residual)
    for rows in (1, 3, 16, 17, 33):
        got = linears.linear_add(x[:rows], weight, residual[:rows])
        assert torch.equal(got, batch[:rows])
    alone = linears.linear(x[21:22], weight)
    assert torch.equal(alone[0], linears.linear(x, weight)[21])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linears.linear_add(x, weight, residual), batch)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_layout_stores_columns_only_where_that_pays_and_changes_no_value(dtype):
    """bf16 where oneDNN runs it: the transpose contiguous (torch's bmm over the view was
    5-25x slower there); elsewhere the matrix as loaded. Either way the same bits as the
    view's sums, so a disk tier written before the change keeps its answers."""
    gen = torch.Generator().manual_seed(3)
    plain = (torch.randn(1536, 576, generator=gen) / 24).to(dtype)
    x = torch.randn(37, 576, generator=gen).to(dtype)
    packed = LINEARS["chunked"].pack(plain)
    assert packed.shape == plain.shape and torch.equal(packed, plain)
    if columns_pay(dtype):
        assert packed.t().is_contiguous() and packed.data_ptr() != plain.data_ptr()
    else:
        assert packed is plain
    assert columns_pay(torch.float32) is False
    linear = LINEARS["chunked"].linear
    assert torch.equal(linear(x, packed), linear(x, plain))


def test_a_models_matrices_lie_in_the_order_a_step_reads_them(smollm2_fp32):
    model = smollm2_fp32.model
    assert model.prepacked
    layers = model.weights.layers
    names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
    starts = [getattr(layer, name).packed.data_ptr() for layer in layers for name in names]
    starts.append(model._lm_head.packed.data_ptr())
    assert starts == sorted(starts) and starts[0] % HUGE_PAGE_BYTES == 0
    if Path("/sys/kernel/mm/transparent_hugepage").is_dir():
        assert "hg" in vm_flags(starts[-1])
