"""kernels.cpu.bf16_linear (kernels/cpu/bf16_linear.c): fp32 linears over bf16-stored
weights, against the float64 oracle and the torch twin; one fixed order per output, so
a row's result does not depend on the rows beside it; its refusals."""

from __future__ import annotations

import platform

import pytest
import torch

from kernels.cpu.bf16_linear import (
    bf16_linear,
    bf16_linear_available,
    bf16_linear_reference,
    pack_bf16_weight,
)

AVAILABLE = bf16_linear_available("cpu", torch.float32)
needs_kernel = pytest.mark.skipif(
    not AVAILABLE and platform.machine() != "x86_64",
    reason="the kernel is written for x86's AVX2; other CPUs keep oneDNN's linears",
)


def _inputs(m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16().float()
    bias = torch.randn(n, generator=gen)
    residual = torch.randn(m, n, generator=gen)
    return x, w, bias, residual


def _oracle(x, w, bias, residual):
    out = x.double() @ w.double().t()
    if bias is not None:
        out = out + bias.double()
    if residual is not None:
        out = out + residual.double()
    return out


def test_the_packed_layout_is_documented_one():
    # Pure C, on every CPU: W[row][k] at ((row // 16) * K + k) * 16 + p, where p is the
    # row's place in its block with the middle two groups of four swapped.
    n, k = 20, 5  # two column blocks, the second padded
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    packed = pack_bf16_weight(w).packed
    assert packed.numel() == 2 * 16 * k
    place = (
        {c: c for c in range(16)}
        | {8 + i: 4 + i for i in range(4)}
        | {4 + i: 8 + i for i in range(4)}
    )
    for row in range(n):
        for col in range(k):
            nb, c = divmod(row, 16)
            assert packed[(nb * k + col) * 16 + place[c]] == w[row, col]
    assert bool((packed.view(2, k, 16)[1][:, 8:] == 0).all())  # rows 20.. of block 1: zeros


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 40])
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (20, 70), (16 * 9, 1)])
def test_bf16_linear_matches_the_oracle_and_its_twin(m, n, k):
    x, w, bias, residual = _inputs(m, n, k)
    weight = pack_bf16_weight(w)
    for b, r in [(None, None), (bias, None), (None, residual), (bias, residual)]:
        got = bf16_linear(x, weight, b, r)
        assert got.shape == (m, n) and got.dtype == torch.float32
        expected = _oracle(x, w, b, r)
        # fp32 sums of k products: error grows like sqrt(k) ulps of the terms
        torch.testing.assert_close(got.double(), expected, atol=2e-5 * k**0.5, rtol=1e-5)
        torch.testing.assert_close(got, bf16_linear_reference(x, w, b, r), atol=1e-4, rtol=1e-4)


@needs_kernel
def test_weights_widen_exactly_and_round_to_bf16_when_packed():
    # x = identity rows: each output is one weight times one, so any loss in the
    # widening shows. fp32 weights are rounded to nearest bf16 on packing.
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 40, generator=gen)
    got = bf16_linear(torch.eye(40), pack_bf16_weight(w))
    assert torch.equal(got, w.bfloat16().float().t())


@needs_kernel
def test_a_rows_output_does_not_depend_on_the_rows_beside_it():
    """The property issue 26 needs of the linears: one summation order per output."""
    x, w, bias, residual = _inputs(23, 200, 576, seed=4)
    weight = pack_bf16_weight(w)
    batch = bf16_linear(x, weight, bias, residual)
    for i in (0, 5, 6, 17, 22):
        alone = bf16_linear(
            x[i : i + 1].contiguous(), weight, bias, residual[i : i + 1].contiguous()
        )
        assert torch.equal(alone[0], batch[i])
    order = torch.randperm(23, generator=torch.Generator().manual_seed(5))
    shuffled = bf16_linear(x[order].contiguous(), weight, bias, residual[order].contiguous())
    assert torch.equal(shuffled, batch[order])
    for rows in (3, 8, 12):  # other tile splits of the same rows
        assert torch.equal(bf16_linear(x[:rows], weight, bias, residual[:rows]), batch[:rows])


@needs_kernel
def test_threads_do_not_change_the_sums():
    x, w, _, residual = _inputs(9, 576, 576, seed=6)
    weight = pack_bf16_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = bf16_linear(x, weight, None, residual)
        torch.set_num_threads(2)
        two = bf16_linear(x, weight, None, residual)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_strided_rows_and_an_empty_batch():
    x, w, _, residual = _inputs(12, 64, 96)
    weight = pack_bf16_weight(w)
    wide = torch.zeros(12, 200)
    wide[:, 50:146] = x
    res_wide = torch.zeros(12, 100)
    res_wide[:, :64] = residual
    got = bf16_linear(wide[:, 50:146], weight, None, res_wide[:, :64])
    assert torch.equal(got, bf16_linear(x, weight, None, residual))
    assert bf16_linear(x[:0], weight).shape == (0, 64)


def test_bad_input_is_refused_before_any_work():
    x, w, bias, residual = _inputs(4, 32, 64)
    with pytest.raises(ValueError, match="2-D floating"):
        pack_bf16_weight(w.to(torch.int32))
    weight = pack_bf16_weight(w)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\] fp32"):
        bf16_linear(x[:, :32], weight)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\] fp32"):
        bf16_linear(x.bfloat16(), weight)
    with pytest.raises(ValueError, match=r"bias must be \[32\]"):
        bf16_linear(x, weight, bias[:31])
    with pytest.raises(ValueError, match=r"residual must be \[4, 32\]"):
        bf16_linear(x, weight, None, residual[:3])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="-mno-avx2 is an x86 flag")
def test_a_build_without_avx2_refuses(tmp_path, monkeypatch):
    """What an x86 CPU without AVX2 gets: the kernel says unavailable and returns -1,
    writing nothing; packing (plain C) still works."""
    from kernels.cpu import native

    monkeypatch.setattr(native, "_build_dir", tmp_path / "kernels")
    lib = native.load(native.build("gcc", [*native.default_flags(), "-mno-avx2"]))
    assert lib.chatsvc_bf16_linear_available() == 0
    x, w, _, _ = _inputs(4, 32, 64)
    weight = pack_bf16_weight(w)
    out = torch.full((4, 32), 7.0)
    args = (x.data_ptr(), 64, 4, weight.packed.data_ptr(), 32, 64, None, None, 0)
    assert lib.chatsvc_bf16_linear(*args, out.data_ptr(), 32, 1) == -1
    assert bool((out == 7.0).all())
