"""kernels.linear: every weight layout's matmuls compute the plain ones, and a
model's prepack_weights maps to the layout the kernels allow here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.backend import ENV_VAR, tile_linears_available
from kernels.linear import LINEARS, WEIGHT_LAYOUTS, can_prepack, choose_layout

CPU = torch.device("cpu")


def _available(dtype):
    return [
        layout
        for layout in WEIGHT_LAYOUTS
        if layout == "plain"
        or (layout == "onednn" and can_prepack(CPU, dtype))
        or (layout == "tiles" and tile_linears_available(CPU, dtype))
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_layout_computes_the_plain_matmuls(dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(dtype)
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
    assert choose_layout(None, CPU, torch.float16) == "plain"
    with pytest.raises(ValueError, match="needs fp32/bf16"):
        choose_layout(True, CPU, torch.float16)
    with pytest.raises(ValueError, match="one of"):
        choose_layout("blocked", CPU, torch.float32)
    if can_prepack(CPU, torch.bfloat16):
        assert choose_layout(None, CPU, torch.bfloat16) == "onednn"
    monkeypatch.setenv(ENV_VAR, "native")
    if tile_linears_available(CPU, torch.bfloat16):
        assert choose_layout(None, CPU, torch.bfloat16) == "tiles"
        assert choose_layout("onednn", CPU, torch.bfloat16) == "onednn"
