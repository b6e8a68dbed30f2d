"""A model's packed matrices moved onto huge pages, in the order a step reads them.

A decode step streams every matrix from memory once per step. On 4 KiB pages every
page of a matrix costs a TLB walk and the hardware prefetchers start again at each
page's edge; on 2 MiB pages one int8 linear of one row took 0.85-0.91x the time
(docs/kernels.md and docs/benchmarks.md, "weights on huge pages"). One region for the
whole model, in the step's order, also makes a step's reads one ascending sweep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from kernels.kv_layout import huge_page_memory

ALIGN_BYTES = 64  # each matrix from a cache line of its own
Packed = TypeVar("Packed")


def on_huge_pages(weights: Sequence[Packed]) -> list[Packed]:
    """``weights`` with each native linear's packed matrix (a NamedTuple holding a CPU
    ``packed`` tensor: ``NarrowWeight``, ``PairWeight``, ``TileWeight``) copied into one
    huge-page region, one after another in the given order; anything else (plain or
    oneDNN tensors, a GPU tensor) is returned as it is. The values are unchanged."""
    movable = [_movable(w) for w in weights]
    offsets, total = [], 0
    for weight, move in zip(weights, movable, strict=True):
        offsets.append(total)
        if move:
            total += -(-weight.packed.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    if total == 0:
        return list(weights)
    region = huge_page_memory(total)
    placed = []
    for weight, move, start in zip(weights, movable, offsets, strict=True):
        if not move:
            placed.append(weight)
            continue
        home = region[start : start + weight.packed.nbytes].view(weight.packed.dtype)
        home.copy_(weight.packed.reshape(-1))
        placed.append(weight._replace(packed=home))
    return placed


def _movable(weight: object) -> bool:
    packed = getattr(weight, "packed", None)
    return (
        hasattr(weight, "_replace")
        and isinstance(packed, torch.Tensor)
        and packed.device.type == "cpu"
        and packed.is_contiguous()
        and packed.dim() == 1
    )
