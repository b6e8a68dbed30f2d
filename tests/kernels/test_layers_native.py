"""RoPE and SwiGLU: the native C loops against their torch references."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_close

import kernels
from kernels.rope import apply_rope_native, apply_rope_torch
from kernels.swiglu import swiglu_native, swiglu_torch


def _tables(rows, head_dim, dtype, gen):
    angles = torch.rand(rows, 1, head_dim // 2, generator=gen) * 100
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 29, 130])  # 130: rows split across threads
def test_native_rope_rotates_like_the_reference(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    # q and k as strided views inside a fused projection, with v after them.
    qkv = torch.randn(rows, 15, 64, generator=gen).to(dtype)
    cos, sin = _tables(rows, 64, dtype, gen)
    expected = qkv.clone()
    apply_rope_torch(expected[:, :12], cos, sin)
    apply_rope_native(qkv[:, :12], cos, sin)
    assert_close(qkv, expected, dtype)
    assert torch.equal(qkv[:, 12:], expected[:, 12:])  # v untouched
    # bf16 rounds where torch's ops round: at most about one bf16 step of the largest
    # value apart (fp32: rounding order only).
    step = 2**-7 if dtype == torch.bfloat16 else 1e-6
    largest = float(expected.float().abs().max())
    assert float((qkv.float() - expected.float()).abs().max()) <= step * largest


def test_rope_checks_its_tables():
    x = torch.randn(4, 3, 64)
    cos, sin = _tables(4, 64, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="cos must be"):
        kernels.apply_rope_(x, cos[:3], sin)
    with pytest.raises(ValueError, match="sin must be"):
        kernels.apply_rope_(x, cos, sin.bfloat16())
    with pytest.raises(ValueError, match="D even"):
        kernels.apply_rope_(torch.randn(4, 3, 63), cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 17, 100])
def test_native_swiglu_matches_the_reference(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    # Gates spanning the saturated tails of the sigmoid and zero.
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 8).to(dtype)
    gate_up[0, :3] = torch.tensor([0.0, -100.0, 100.0]).to(dtype)
    out = swiglu_native(gate_up)
    expected = swiglu_torch(gate_up)
    assert out.shape == (rows, 1536) and out.dtype == dtype
    assert_close(out, expected, dtype)


def test_swiglu_refuses_an_odd_width():
    with pytest.raises(ValueError, match="2 \\* I"):
        kernels.swiglu(torch.randn(3, 7))
