"""RMSNorm: the native C loop against torch's rms_norm (its reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import assert_close

import kernels
from kernels.rms_norm import rms_norm_native


def _reference(x, weight, eps):
    return F.rms_norm(x.double(), (x.shape[-1],), weight.double(), eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 31, 200])  # 200: rows split across threads
def test_native_rms_norm_matches_the_reference(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    out = rms_norm_native(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, _reference(x, weight, 1e-5), dtype)
    assert_close(out, kernels.rms_norm(x, weight, 1e-5, backend="torch"), dtype)


def test_strided_rows_and_other_shapes():
    wide = torch.randn(8, 1000)
    x = wide[:, :576]  # rows 1000 apart, as a view into a fused projection would be
    weight = torch.randn(576)
    assert_close(kernels.rms_norm(x, weight, 1e-6), _reference(x, weight, 1e-6), torch.float32)
    cube = torch.randn(2, 3, 576)  # not 2-D: the torch path
    assert_close(
        kernels.rms_norm(cube, weight, 1e-6), _reference(cube, weight, 1e-6), torch.float32
    )
    assert kernels.rms_norm(torch.empty(0, 576), weight, 1e-6).shape == (0, 576)


def test_rms_norm_refuses_a_weight_that_does_not_fit():
    x = torch.randn(4, 576)
    with pytest.raises(ValueError, match="weight must be"):
        kernels.rms_norm(x, torch.randn(575), 1e-6)
    with pytest.raises(ValueError, match="does not match"):
        kernels.rms_norm(x, torch.randn(576).bfloat16(), 1e-6)
