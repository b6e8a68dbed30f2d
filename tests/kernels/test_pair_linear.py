"""kernels.cpu.pair_linear (kernels/cpu/pair_linear.c): bf16 linears on AVX512-BF16 dot
pairs, against the float64 oracle and the torch twin; one fixed order per output, so a
row's result does not depend on the rows beside it or the thread count; its refusals.

On a CPU without AVX512-BF16 the kernel cannot run: each test then checks that it says
so (and returns -1, writing nothing) instead of running the kernel.
"""

from __future__ import annotations

import platform

import pytest
import torch

from kernels.cpu import native
from kernels.cpu.pair_linear import (
    pack_pair_weight,
    pair_linear,
    pair_linear_available,
    pair_linear_reference,
)

AVAILABLE = pair_linear_available("cpu", torch.bfloat16)


def _inputs(m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    residual = torch.randn(m, n, generator=gen).bfloat16()
    return x, w, bias, residual


def _runs_here() -> bool:
    """True where the kernel runs; elsewhere check that it refuses and writes nothing."""
    if AVAILABLE:
        return True
    x, w, _, _ = _inputs(2, 16, 8)
    weight = pack_pair_weight(w)
    out = torch.full((2, 16), 7.0, dtype=torch.bfloat16)
    status = native.require().chatsvc_pair_linear(
        x.data_ptr(), 8, 2, weight.packed.data_ptr(), 16, 8, None, None, 0, out.data_ptr(), 16, 1
    )
    assert status == -1 and bool((out == 7.0).all())
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        pair_linear(x, weight)
    return False


def test_the_packed_layout_is_the_documented_one():
    # Plain C, on every CPU: W[row][k] at ((row // 16 * KP + k // 2) * 16 + row % 16) * 2 + k % 2
    n, k = 20, 5  # two column blocks (the second padded), an odd K (its last pair padded)
    w = (torch.arange(n * k, dtype=torch.float32).reshape(n, k) - 50).bfloat16()
    packed = pack_pair_weight(w).packed
    kp = (k + 1) // 2
    assert packed.numel() == 2 * 16 * kp * 2
    for row in range(n):
        for col in range(k):
            nb, c = divmod(row, 16)
            assert packed[((nb * kp + col // 2) * 16 + c) * 2 + col % 2] == w[row, col]
    grid = packed.view(2, kp, 16, 2)
    assert bool((grid[1][:, 4:] == 0).all()) and bool((grid[:, kp - 1, :, 1] == 0).all())


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (20, 70), (33, 7)])
def test_pair_linear_matches_the_oracle_and_its_twin(m, n, k):
    if not _runs_here():
        return
    x, w, bias, residual = _inputs(m, n, k)
    weight = pack_pair_weight(w)
    for b, r in [(None, None), (bias, None), (None, residual), (bias, residual)]:
        got = pair_linear(x, weight, b, r)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        expected = x.double() @ w.double().t()
        if b is not None:
            expected = expected + b.double()
        if r is not None:
            expected = expected + r.double()
        # One rounding to bf16 at the end (and fp32 sums of k products before it).
        torch.testing.assert_close(got.double(), expected, atol=1e-2, rtol=1e-2)
        twin = pair_linear_reference(x, w, b, r)
        torch.testing.assert_close(got.float(), twin.float(), atol=1e-2, rtol=8e-3)


def test_a_rows_output_does_not_depend_on_the_rows_beside_it_or_the_threads():
    """The property issue 26 needs of the linears: one summation order per output."""
    if not _runs_here():
        return
    x, w, bias, residual = _inputs(40, 200, 576, seed=4)
    weight = pack_pair_weight(w)
    batch = pair_linear(x, weight, bias, residual)
    for i in (0, 5, 6, 17, 39):
        alone = pair_linear(x[i : i + 1], weight, bias, residual[i : i + 1])
        assert torch.equal(alone[0], batch[i])
    order = torch.randperm(40, generator=torch.Generator().manual_seed(5))
    assert torch.equal(pair_linear(x[order], weight, bias, residual[order]), batch[order])
    for rows in (3, 8, 12, 30):
        assert torch.equal(pair_linear(x[:rows], weight, bias, residual[:rows]), batch[:rows])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(pair_linear(x, weight, bias, residual), batch)
    finally:
        torch.set_num_threads(before)


def test_bad_input_is_refused_before_any_work():
    x, w, bias, residual = _inputs(4, 32, 64)
    with pytest.raises(ValueError, match="2-D floating"):
        pack_pair_weight(w.to(torch.int32))
    weight = pack_pair_weight(w)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\] bf16"):
        pair_linear(x[:, :32], weight)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\] bf16"):
        pair_linear(x.float(), weight)
    with pytest.raises(ValueError, match=r"bias must be \[32\]"):
        pair_linear(x, weight, bias[:31])
    with pytest.raises(ValueError, match=r"residual must be \[4, 32\]"):
        pair_linear(x, weight, None, residual[:3])


def test_a_build_without_avx512_bf16_refuses(variant_library):
    """What a CPU without AVX512-BF16 gets: the kernel says unavailable and returns -1,
    writing nothing (the model then takes the narrow blocks); packing still works."""
    lib = variant_library(["-mno-avx512bf16"] if platform.machine() == "x86_64" else [])
    assert lib.chatsvc_pair_linear_available() == 0
    x, w, _, _ = _inputs(2, 16, 8)
    weight = pack_pair_weight(w)
    out = torch.full((2, 16), 7.0, dtype=torch.bfloat16)
    args = (x.data_ptr(), 8, 2, weight.packed.data_ptr(), 16, 8, None, None, 0)
    assert lib.chatsvc_pair_linear(*args, out.data_ptr(), 16, 1) == -1
    assert bool((out == 7.0).all())
