"""kernels.weight_pages: a model's packed matrices moved onto huge pages, in order,
their values unchanged; what is not a native packed matrix stays where it is."""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.cpu.narrow_linear import NarrowWeight
from kernels.cpu.pair_linear import PairWeight
from kernels.kv_layout import HUGE_PAGE_BYTES
from kernels.weight_pages import ALIGN_BYTES, on_huge_pages
from tests.memory_maps import vm_flags

THP = Path("/sys/kernel/mm/transparent_hugepage").is_dir()


def test_packed_matrices_move_in_order_onto_one_advised_region_unchanged():
    gen = torch.Generator().manual_seed(0)
    narrow = NarrowWeight(
        torch.randint(0, 255, (3 * 1024 * 1024 + 5,), dtype=torch.uint8, generator=gen),
        torch.rand(7, generator=gen),
        (7, 9),
        "int8",
    )
    pair = PairWeight(torch.randn(1001, generator=gen).bfloat16(), (3, 3))
    fp32 = NarrowWeight(torch.randn(333, generator=gen), None, (3, 111), "fp32")
    plain = torch.randn(4, 4, generator=gen)  # a plain matrix: left alone
    weights = [narrow, plain, pair, fp32]
    placed = on_huge_pages(weights)
    assert placed[1] is plain
    starts = []
    for before, after in zip([narrow, pair, fp32], [placed[0], placed[2], placed[3]], strict=True):
        assert type(after) is type(before) and after.shape == before.shape
        assert torch.equal(after.packed, before.packed)
        assert after.packed.dtype == before.packed.dtype
        assert after.packed.data_ptr() != before.packed.data_ptr()
        assert after.packed.data_ptr() % ALIGN_BYTES == 0
        starts.append(after.packed.data_ptr())
    assert placed[0].scale is narrow.scale
    assert starts == sorted(starts)  # the given order
    assert starts[0] % HUGE_PAGE_BYTES == 0
    assert starts[1] - starts[0] == -(-narrow.packed.numel() // ALIGN_BYTES) * ALIGN_BYTES
    if THP:
        assert "hg" in vm_flags(starts[0])
    assert on_huge_pages([plain]) == [plain] and on_huge_pages([]) == []
