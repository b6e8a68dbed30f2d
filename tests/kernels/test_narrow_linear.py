"""kernels.cpu.narrow_linear (kernels/cpu/narrow_linear.c, narrow_int8.c): fp32 linears
over bf16-, int8- and fp32-stored weights (int8 against x quantized per group), against
the float64 oracle and the torch twin; one fixed order per output, so a row's result does
not depend on the rows beside it; its refusals."""

from __future__ import annotations

import platform

import pytest
import torch

from kernels.cpu.narrow_linear import (
    ACTIVATION_GROUP,
    narrow_linear,
    narrow_linear_available,
    narrow_linear_reference,
    pack_bf16_weight,
    pack_fp32_weight,
    pack_int8_weight,
    quantize_int8,
    quantize_rows,
)

AVAILABLE = narrow_linear_available("cpu", torch.float32)
needs_kernel = pytest.mark.skipif(
    not AVAILABLE and platform.machine() != "x86_64",
    reason="the kernel is written for x86's AVX2; other CPUs keep oneDNN's linears",
)
PACK = {"bf16": pack_bf16_weight, "int8": pack_int8_weight, "fp32": pack_fp32_weight}


def _inputs(m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16().float()
    bias = torch.randn(n, generator=gen)
    residual = torch.randn(m, n, generator=gen)
    return x, w, bias, residual


def _stored(w, format):
    """The weight as the format stores it, in float64."""
    if format == "bf16":
        return w.bfloat16().double()
    if format == "fp32":
        return w.double()
    q, scale = quantize_int8(w)
    return q.double() * scale.double()[:, None]


def _input_rows(x, format):
    """x as the kernel multiplies it, in float64 (int8: quantized per group)."""
    if format != "int8":
        return x.double()
    q, step = quantize_rows(x)
    values = q.double().view(x.shape[0], -1, ACTIVATION_GROUP) * step.double()[:, :, None]
    return values.view(x.shape[0], -1)[:, : x.shape[1]]


def _oracle(x, w, bias, residual, format):
    out = _input_rows(x, format) @ _stored(w, format).t()
    if bias is not None:
        out = out + bias.double()
    if residual is not None:
        out = out + residual.double()
    return out


def test_the_packed_layouts_are_the_documented_ones():
    # Pure C, on every CPU. bf16: W[row][k] at ((row // 16) * K + k) * 16 + p, where p is
    # the row's place in its block (the middle two groups of four swapped). int8: K padded
    # to KP, four k of a row side by side, offset to unsigned:
    # q[row][k] + 128 at ((row // 16) * KP / 4 + k // 4) * 64 + (row % 16) * 4 + k % 4.
    n, k = 20, 5  # two column blocks, the second padded
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k) - 50
    swap = {c: c for c in range(16)} | {8 + i: 4 + i for i in range(4)}
    swap |= {4 + i: 8 + i for i in range(4)}
    bf16 = pack_bf16_weight(w)
    int8 = pack_int8_weight(w)
    q, scale = quantize_int8(w)
    kp = ACTIVATION_GROUP
    assert bf16.packed.numel() == 2 * 16 * k and int8.packed.numel() == 2 * 16 * kp
    assert int8.packed.dtype == torch.uint8
    assert torch.equal(int8.scale, scale) and bf16.scale is None
    for row in range(n):
        for col in range(k):
            nb, c = divmod(row, 16)
            assert bf16.packed[(nb * k + col) * 16 + swap[c]] == w[row, col]
            at = ((nb * kp // 4 + col // 4) * 16 + c) * 4 + col % 4
            assert int(int8.packed[at]) == int(q[row, col]) + 128
    assert bool((bf16.packed.view(2, k, 16)[1][:, 8:] == 0).all())  # rows 20.. : zeros
    blocks = int8.packed.view(2, kp // 4, 16, 4)
    assert bool((blocks[1][:, 4:] == 128).all())  # rows 20.. : zeros (offset)
    assert bool((blocks[:, 2:] == 128).all()) and bool((blocks[:, 1, :, 1:] == 128).all())


def test_int8_quantization_is_symmetric_per_row_and_keeps_each_rows_peak():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 300, generator=gen) * torch.logspace(-3, 1, 64)[:, None]
    w[5] = 0.0  # an all-zero row: scale 0, zeros back
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and int(q.min()) >= -127
    back = q.float() * scale[:, None]
    # each row's largest magnitude is a level; every value is within half a step
    assert torch.allclose(back.abs().amax(dim=1), w.abs().amax(dim=1), rtol=1e-6)
    assert bool(((back - w).abs() <= scale[:, None] / 2 * (1 + 1e-5)).all())
    assert float(scale[5]) == 0.0 and bool((back[5] == 0).all())


def test_rows_are_quantized_per_group_and_keep_each_groups_peak():
    g = ACTIVATION_GROUP
    k = 2 * g + g // 3  # the third group partial
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, k, generator=gen)
    x[1, 3] = 900.0  # an outlier: only its own group's step grows
    x[2, g : 2 * g] = 0.0  # an all-zero group: step 0, zeros back
    q, step = quantize_rows(x)
    assert q.shape == (5, 3 * g) and step.shape == (5, 3) and q.dtype == torch.int8
    assert bool((q[:, k:] == 0).all())  # the padding
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    back = (q.float().view(5, 3, g) * step[:, :, None]).view(5, 3 * g)[:, :k]
    groups = torch.nn.functional.pad(x, (0, 3 * g - k)).view(5, 3, g)
    assert torch.allclose(step, groups.abs().amax(dim=2) / 127)
    assert bool(((back - x).abs() <= step.repeat_interleave(g, 1)[:, :k] / 2 * 1.0001).all())
    assert float(step[2, 1]) == 0.0 and bool((back[2, g : 2 * g] == 0).all())
    assert float(step[1, 0]) > 7 > float(step[1, 1])  # the outlier's group only


@needs_kernel
@pytest.mark.parametrize("format", ["bf16", "int8", "fp32"])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 6, 7, 13, 24, 25, 40])
@pytest.mark.parametrize(
    "n, k", [(960, 576), (576, 1536), (20, 70), (16 * 9, 1), (40, 130), (24, 67)]
)
def test_narrow_linear_matches_the_oracle_and_its_twin(format, m, n, k):
    x, w, bias, residual = _inputs(m, n, k)
    weight = PACK[format](w)
    for b, r in [(None, None), (bias, None), (None, residual), (bias, residual)]:
        got = narrow_linear(x, weight, b, r)
        assert got.shape == (m, n) and got.dtype == torch.float32
        expected = _oracle(x, w, b, r, format)
        # fp32 sums of k products: error grows like sqrt(k) ulps of the terms
        torch.testing.assert_close(got.double(), expected, atol=2e-5 * k**0.5, rtol=1e-5)
        twin = narrow_linear_reference(x, w, b, r, format)
        torch.testing.assert_close(got, twin, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_weights_widen_exactly():
    # x = identity rows: each output is one stored weight times one, so any loss in the
    # widening shows. fp32 weights round to nearest bf16. int8: x = 127 x identity, each
    # group's step exactly 1, so an output is 127 q times its scale, rounded once.
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 40, generator=gen)
    got = narrow_linear(torch.eye(40), pack_bf16_weight(w))
    assert torch.equal(got, w.bfloat16().float().t())
    q, scale = quantize_int8(w)
    got = narrow_linear(127 * torch.eye(40), pack_int8_weight(w))
    assert torch.equal(got, (127 * q.float() * scale[:, None]).t())
    assert torch.equal(narrow_linear(torch.eye(40), pack_fp32_weight(w)), w.t())


@needs_kernel
@pytest.mark.parametrize("format", ["bf16", "int8", "fp32"])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(format):
    """The property issue 26 needs of the linears: one summation order per output."""
    x, w, bias, residual = _inputs(40, 200, 576, seed=4)
    weight = PACK[format](w)
    batch = narrow_linear(x, weight, bias, residual)
    for i in (0, 5, 6, 17, 22, 39):
        one_row = x[i : i + 1].contiguous()
        alone = narrow_linear(one_row, weight, bias, residual[i : i + 1].contiguous())
        assert torch.equal(alone[0], batch[i])
    order = torch.randperm(40, generator=torch.Generator().manual_seed(5))
    shuffled = narrow_linear(x[order].contiguous(), weight, bias, residual[order].contiguous())
    assert torch.equal(shuffled, batch[order])
    for rows in (3, 8, 12, 30):  # other tile splits of the same rows
        assert torch.equal(narrow_linear(x[:rows], weight, bias, residual[:rows]), batch[:rows])


@needs_kernel
@pytest.mark.parametrize("format", ["bf16", "int8", "fp32"])
def test_the_avx512_tiles_give_the_avx2_tiles_bits(format):
    """Where the build has AVX-512 (int8: AVX-512 VNNI), its tiles (four blocks at a time)
    run the step; they must sum exactly as the AVX2 tiles (one or two blocks) do. Shapes
    with a partial last block, tiles of 1-4 blocks at the ends of the threads' ranges,
    every row count a tile takes and one past it. (On an AVX2-only build both calls take
    the same tiles.)"""
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for n, k in [(20, 37), (16 * 9 + 5, 70), (1000, 576), (16 * 13, 1)]:
                x, w, bias, residual = _inputs(13, n, k, seed=n + k)
                weight = PACK[format](w)
                for m in range(1, 14):
                    for b, r in [
                        (None, None),
                        (bias, None),
                        (None, residual[:m]),
                        (bias, residual[:m]),
                    ]:
                        wide = narrow_linear(x[:m], weight, b, r)
                        narrow = narrow_linear(x[:m], weight, b, r, avx2_tiles=True)
                        assert torch.equal(wide, narrow), (threads, n, k, m)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("format", ["bf16", "fp32"])
def test_one_row_sums_as_the_row_tiles_do(format):
    """One row has tiles of its own (four blocks side by side, the weights' rate at batch
    1); a row alone must get the bits it gets among others, whichever tiles take those.
    Partial last blocks, 1-4 blocks left at the ends of the threads' ranges."""
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for n, k in [(20, 37), (16 * 9 + 5, 70), (1000, 576), (16 * 13, 1), (16 * 7, 9)]:
                x, w, bias, residual = _inputs(3, n, k, seed=n * k)
                weight = PACK[format](w)
                for b, r in [(None, None), (bias, None), (None, residual), (bias, residual)]:
                    for avx2 in (False, True):
                        rows = narrow_linear(x, weight, b, r, avx2_tiles=avx2)
                        for i in range(3):
                            alone = narrow_linear(
                                x[i : i + 1].contiguous(),
                                weight,
                                b,
                                None if r is None else r[i : i + 1].contiguous(),
                                avx2_tiles=avx2,
                            )
                            assert torch.equal(alone[0], rows[i]), (threads, n, k, i)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_threads_do_not_change_the_sums():
    x, w, _, residual = _inputs(9, 576, 576, seed=6)
    before = torch.get_num_threads()
    for weight in (pack_bf16_weight(w), pack_int8_weight(w)):
        try:
            torch.set_num_threads(1)
            one = narrow_linear(x, weight, None, residual)
            torch.set_num_threads(2)
            two = narrow_linear(x, weight, None, residual)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, two)


@needs_kernel
def test_strided_rows_and_an_empty_batch():
    x, w, _, residual = _inputs(12, 64, 96)
    wide = torch.zeros(12, 200)
    wide[:, 50:146] = x
    res_wide = torch.zeros(12, 100)
    res_wide[:, :64] = residual
    for weight in (pack_bf16_weight(w), pack_int8_weight(w)):
        got = narrow_linear(wide[:, 50:146], weight, None, res_wide[:, :64])
        assert torch.equal(got, narrow_linear(x, weight, None, residual))
        assert narrow_linear(x[:0], weight).shape == (0, 64)
    # No inputs at all (K = 0): the sums are empty, bias and residual remain.
    bias = torch.randn(64)
    for pack in (pack_bf16_weight, pack_int8_weight):
        got = narrow_linear(
            torch.zeros(30, 0),
            pack(torch.zeros(64, 0)),
            bias,
            residual[:1].expand(30, 64).contiguous(),
        )
        assert torch.equal(got, (bias + residual[:1]).expand(30, 64))


def test_bad_input_is_refused_before_any_work():
    x, w, bias, residual = _inputs(4, 32, 64)
    for pack in (pack_bf16_weight, pack_int8_weight):
        with pytest.raises(ValueError, match="2-D floating"):
            pack(w.to(torch.int32))
    weight = pack_bf16_weight(w)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\] fp32"):
        narrow_linear(x[:, :32], weight)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\] fp32"):
        narrow_linear(x.bfloat16(), weight)
    with pytest.raises(ValueError, match=r"bias must be \[32\]"):
        narrow_linear(x, weight, bias[:31])
    with pytest.raises(ValueError, match=r"residual must be \[4, 32\]"):
        narrow_linear(x, weight, None, residual[:3])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="-mno-avx2 is an x86 flag")
def test_a_build_without_avx2_refuses(variant_library):
    """What an x86 CPU without AVX2 gets: the kernel says unavailable and returns -1,
    writing nothing; packing (plain C) still works. An unknown format is refused too."""
    from kernels.cpu import native

    x, w, _, _ = _inputs(4, 32, 64)
    weight = pack_bf16_weight(w)
    out = torch.full((4, 32), 7.0)
    args = (x.data_ptr(), 64, 4, weight.packed.data_ptr())
    rest = (None, 32, 64, None, None, 0, out.data_ptr(), 32, 1, 1)
    if AVAILABLE:
        assert native.require().chatsvc_narrow_linear(*args, 3, *rest) == -1
    # A CPU without AVX2 has no AVX-512 either (test_native builds the same variant).
    lib = variant_library(["-mno-avx512f", "-mno-avx2"])
    assert lib.chatsvc_narrow_linear_available() == 0
    assert lib.chatsvc_narrow_linear(*args, 0, *rest) == -1
    assert bool((out == 7.0).all())
