"""kernels.cpu.tile_linear (kernels/cpu/tile_linear.c) against its torch twin, and its refusals."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_close

from kernels.cpu.tile_linear import (
    pack_tile_weight,
    tile_linear,
    tile_linear_available,
    tile_linear_reference,
)

TILES = tile_linear_available("cpu", torch.bfloat16)


def _refused_without_tiles(x, weight) -> bool:
    """On a CPU without the tile unit the kernel refuses to run (True: nothing more to
    check here); with one, False."""
    if TILES:
        return False
    with pytest.raises(RuntimeError, match="no tile unit"):
        tile_linear(x, weight)
    return True


def _inputs(m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    residual = torch.randn(m, n, generator=gen).bfloat16()
    return x, w, bias, residual


def test_the_packed_layout_is_the_tile_units_b_operand():
    # Pure C, on every CPU: element (n, k) of W lands where the layout comment says.
    n, k = 20, 70  # two column blocks, three 32-deep steps, both padded
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k).bfloat16()
    packed = pack_tile_weight(w).packed
    kbs = 3
    assert packed.numel() == 2 * kbs * 512
    for row, col in [(0, 0), (5, 1), (15, 31), (16, 32), (19, 69), (3, 64)]:
        nb, c, kb, kp, j = row // 16, row % 16, col // 32, (col % 32) // 2, col % 2
        assert packed[((nb * kbs + kb) * 16 + kp) * 32 + 2 * c + j] == w[row, col]
    # Padding (column 20 onwards of block 1, K 70 onwards of step 2) is zero.
    assert packed[((1 * kbs + 2) * 16 + 15) * 32 + 2 * 15 + 1] == 0


@pytest.mark.parametrize("m", [1, 7, 16, 17, 33, 100])
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (20, 70), (16 * 9, 32)])
def test_tile_linear_matches_its_twin(m, n, k):
    x, w, bias, residual = _inputs(m, n, k)
    weight = pack_tile_weight(w)
    if _refused_without_tiles(x, weight):
        return
    for b, r in [(None, None), (bias, None), (None, residual), (bias, residual)]:
        got = tile_linear(x, weight, b, r)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        assert_close(got, tile_linear_reference(x, w, b, r), torch.bfloat16)


def test_strided_rows_and_an_empty_batch():
    x, w, _, residual = _inputs(12, 64, 96)
    weight = pack_tile_weight(w)
    if _refused_without_tiles(x, weight):
        return
    wide = torch.zeros(12, 200, dtype=torch.bfloat16)
    wide[:, 50:146] = x
    res_wide = torch.zeros(12, 100, dtype=torch.bfloat16)
    res_wide[:, :64] = residual
    got = tile_linear(wide[:, 50:146], weight, None, res_wide[:, :64])
    assert_close(got, tile_linear_reference(x, w, None, residual), torch.bfloat16)
    assert tile_linear(x[:0], weight).shape == (0, 64)


def test_bad_input_is_refused_before_any_work():
    x, w, bias, residual = _inputs(4, 32, 64)
    with pytest.raises(ValueError, match="2-D bf16"):
        pack_tile_weight(w.float())
    weight = pack_tile_weight(w)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        tile_linear(x[:, :32], weight)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        tile_linear(x.float(), weight)
    with pytest.raises(ValueError, match=r"bias must be \[32\]"):
        tile_linear(x, weight, bias[:31])
    with pytest.raises(ValueError, match=r"residual must be \[4, 32\]"):
        tile_linear(x, weight, None, residual[:3])


def test_a_build_without_the_tile_unit_refuses(variant_library):
    """What a CPU without AMX gets (on x86, a build without its instructions): the
    kernel reports no tiles and returns -1, writing nothing; packing still works."""
    import platform

    lib = variant_library(["-mno-amx-tile"] if platform.machine() == "x86_64" else [])
    assert lib.chatsvc_linear_uses_tiles() == 0
    x, w, _, _ = _inputs(4, 32, 64)
    weight = pack_tile_weight(w)
    out = torch.full((4, 32), 7.0, dtype=torch.bfloat16)
    args = (x.data_ptr(), 64, 4, weight.packed.data_ptr(), 32, 64, None, None, 0)
    assert lib.chatsvc_linear(*args, out.data_ptr(), 32, 1) == -1
    assert bool((out == 7.0).all())


def test_a_rows_output_does_not_depend_on_the_rows_beside_it_or_the_threads():
    """Issue 26 needs it of every linear: the tile unit sums each output row from its own
    input row, 32 inputs a step in order, whatever the other rows of its tile."""
    x, w, bias, residual = _inputs(40, 200, 576, seed=4)
    weight = pack_tile_weight(w)
    if _refused_without_tiles(x, weight):
        return
    batch = tile_linear(x, weight, bias, residual)
    for i in (0, 5, 15, 16, 39):
        alone = tile_linear(x[i : i + 1], weight, bias, residual[i : i + 1])
        assert torch.equal(alone[0], batch[i])
    for rows in (3, 17, 33):
        assert torch.equal(tile_linear(x[:rows], weight, bias, residual[:rows]), batch[:rows])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(tile_linear(x, weight, bias, residual), batch)
    finally:
        torch.set_num_threads(before)
