"""The torch element-wise layers give a row the same bits whatever the rows beside it.

RMSNorm, SwiGLU and RoPE on the torch and triton backends (``*_torch``; on CUDA too,
where RMSNorm has its own kernel) must not let a row's values depend on the step's row
count or the thread count (issue 26): each row alone against the same rows in one call
of many, on one and two threads, fp32 and bf16, including widths that are not a multiple
of any vector length and a lone row wide enough that torch would split its sum.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_close

from kernels.rms_norm import rms_norm_torch
from kernels.rope import apply_rope_torch
from kernels.swiglu import swiglu_torch

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _rows_alone(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(37, 576), (61, 1000), (5, 17), (5, 40000)])
def test_rms_norm_rows(threads, rows, hidden, dtype):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    together = rms_norm_torch(x, weight, 1e-5)
    assert torch.equal(together, _rows_alone(lambda r: rms_norm_torch(r, weight, 1e-5), x))
    reference = torch.nn.functional.rms_norm(x.double(), (hidden,), weight.double(), 1e-5)
    assert_close(together, reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(61, 1000), (33, 1536), (7, 17)])
def test_swiglu_rows(threads, rows, inter, dtype):
    """Widths like 1,000 put a thread's boundary inside a row on two threads, where torch's
    own silu computed the tail elements by another formula."""
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    together = swiglu_torch(gate_up)
    assert torch.equal(together, _rows_alone(swiglu_torch, gate_up))
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert_close(together, torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [(9, 64), (5, 80), (7, 18)])
def test_rope_rows(threads, heads, head_dim, dtype):
    """q inside a fused projection (strided rows), 2,000 tokens: several threads' ranges."""
    gen = torch.Generator().manual_seed(head_dim)
    tokens = 2000
    fused = (torch.randn(tokens, heads + 3, head_dim, generator=gen) * 3).to(dtype)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 50
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    together = fused.clone()
    apply_rope_torch(together[:, :heads], cos, sin)
    for t in range(0, tokens, 37):
        alone = fused[t : t + 1].clone()
        apply_rope_torch(alone[:, :heads], cos[t : t + 1], sin[t : t + 1])
        assert torch.equal(alone, together[t : t + 1])
