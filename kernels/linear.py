"""The linear layers of the forward pass, one variant per weight layout.

    layout       weights                                 matmuls
    plain        the ``[out, in]`` matrices as loaded    F.linear, addmm
    onednn       prepacked in oneDNN's blocked layout    torch's oneDNN linears (CPU, fp32/bf16)
    tiles        packed for the CPU's tile unit (AMX)    ``kernels.cpu.tile_linear`` (bf16, native)
    pair_blocks  bf16 input pairs in 16-column blocks    ``kernels.cpu.pair_linear`` (bf16,
                                                         AVX512-BF16 without a tile unit)
    bf16_blocks  bf16 in 16-column blocks               ``kernels.cpu.narrow_linear`` (AVX2; a
                                                         bf16 model's rows summed in fp32)
    int8_blocks  int8 + a scale per row, fp32 model     ``kernels.cpu.narrow_linear`` (AVX2)
    fp32_blocks  fp32 in 16-column blocks, fp32 model   ``kernels.cpu.narrow_linear`` (AVX2)
    chunked      the matrices, stored column by column   torch matmuls of fixed 16-row chunks
                 where that pays (``pack_columns``)
    triton       the matrices as loaded                  ``kernels.matmul`` (CUDA: one program
                                                         shape whatever the row count)

A model picks its layout once, at load (``choose_layout``), packs its matrices with
that variant's ``pack`` and runs every projection through its ``linear`` /
``linear_add`` (the residual add fused into the matmul). Whether the native linears
may run is the kernels' decision (``kernels.backend.tile_linears_available``,
``kernels.backend.pair_linears_available``, ``kernels.backend.narrow_linears_available``).

Invariance (``kernels.invariance``): a row's output must not depend on how many rows the
step has. torch's own matmuls change their summation order with the row count (a single
row takes a matrix-vector path; other counts other blockings), so an invariant model
never uses ``plain`` or ``onednn``: tiles, the pair and narrow blocks, ``chunked`` and on
CUDA ``triton`` (cuBLAS picks kernels and split-K by the shape) sum each row the same way
whatever the step (tiles: the tile unit's fixed order per 32-deep
step; pair blocks: one dot-pair step per two inputs in order; the narrow blocks: one FMA
per input in order; ``chunked``: every matmul call has one shape,
16 rows, padded, which measured bit-identical rows at every position, chunk count and
thread count).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from kernels.backend import (
    narrow_linears_available,
    pair_linears_available,
    tile_linears_available,
)
from kernels.cpu.narrow_linear import (
    NarrowWeight,
    pack_bf16_weight,
    pack_fp32_weight,
    pack_int8_weight,
)
from kernels.cpu.narrow_linear import narrow_linear as _narrow_linear
from kernels.cpu.pair_linear import PairWeight, pack_pair_weight
from kernels.cpu.pair_linear import pair_linear as _pair_linear
from kernels.cpu.tile_linear import TileWeight, pack_tile_weight
from kernels.cpu.tile_linear import tile_linear as _tile_linear
from kernels.matmul import matmul as _triton_matmul

WEIGHT_LAYOUTS = (
    "tiles",
    "pair_blocks",
    "bf16_blocks",
    "int8_blocks",
    "fp32_blocks",
    "onednn",
    "chunked",
    "triton",
    "plain",
)
# Rows of each matmul the chunked layout makes: every call has this shape.
CHUNK_ROWS = 16


class Linears(NamedTuple):
    """One layout's weight packing and matmuls."""

    layout: str
    pack: Callable[[torch.Tensor], Any]  # [out, in] -> the layout's weight (same shape)
    linear: Callable[..., torch.Tensor]  # (x, weight, bias=None) -> x @ weight^T + bias
    linear_add: Callable[..., torch.Tensor]  # (x, weight, residual) -> residual + x @ weight^T


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN weight prepacking is available: a CPU build with mkldnn, in fp32,
    or in bf16 where oneDNN runs bf16 (AVX-512 or AVX-NE-CONVERT: elsewhere, an AVX2
    CPU, its weight reorder refuses bf16 and the plain layout is used)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _onednn_runs_bf16())


@lru_cache(maxsize=1)
def _onednn_runs_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without the query: assume not
        return False


WEIGHT_DTYPES = ("auto", "bf16", "int8", "fp32")
# The layout that stores an fp32 model's weights narrower, by weight dtype.
NARROW_LAYOUTS = {"bf16": "bf16_blocks", "int8": "int8_blocks"}


def choose_layout(
    choice: bool | str | None,
    device: torch.device,
    dtype: torch.dtype,
    weight_dtype: str | None = None,
    exact_in_bf16: Callable[[], bool] = lambda: False,
    invariant: bool = True,
) -> str:
    """A model's ``prepack_weights`` as one of ``WEIGHT_LAYOUTS``: a layout by name, False
    = plain, True or None = the best available here: tiles, then pair_blocks (bf16), then
    (an fp32 model whose weights bf16 holds) bf16_blocks, then for an ``invariant`` model
    the narrow blocks of its dtype (bf16_blocks, fp32_blocks), on CUDA triton, or else
    chunked; for a model that need not be invariant onednn, else (None) plain.

    ``weight_dtype`` (``WEIGHT_DTYPES``; None = "auto") is what an fp32 model stores its
    matrices in: "auto" takes bf16_blocks only where the weights are ``exact_in_bf16()``
    (a bf16 checkpoint: the model is unchanged, read in half the bytes), "bf16" rounds
    any weights to bf16 (bf16_blocks), "int8" quantizes them (int8_blocks), "fp32"
    keeps them. A bf16 model keeps bf16 weights; "int8" and "fp32" are refused there.
    A layout asked for by name is taken as asked, invariant or not. Raises
    ``ValueError`` for a layout or weight dtype not available here."""
    weight_dtype = weight_dtype or "auto"
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    if weight_dtype in ("fp32", "int8") and dtype != torch.float32:
        raise ValueError(f"{weight_dtype} weights run in an fp32 model (dtype fp32), not {dtype}")
    tiles = tile_linears_available(device, dtype)
    pairs = pair_linears_available(device, dtype)
    narrow = narrow_linears_available(device, dtype)
    onednn = can_prepack(device, dtype)
    fp32_narrow = narrow and dtype == torch.float32
    available = {"tiles": tiles, "pair_blocks": pairs, "onednn": onednn, "plain": True}
    available["chunked"] = True
    available["triton"] = device.type == "cuda"
    available |= {"bf16_blocks": narrow, "int8_blocks": fp32_narrow, "fp32_blocks": fp32_narrow}
    if dtype == torch.float32 and weight_dtype in NARROW_LAYOUTS:
        forced = NARROW_LAYOUTS[weight_dtype]
        if choice not in (None, True, forced):
            raise ValueError(
                f"{weight_dtype} weights in an fp32 model are {forced}, not {choice!r}"
            )
        choice = forced
    for stored, layout in NARROW_LAYOUTS.items():
        if choice == layout and weight_dtype not in ("auto", stored):
            raise ValueError(f"the {layout} layout stores {stored} weights, not {weight_dtype}")
    if choice is False:
        return "plain"
    if choice is None or choice is True:
        if tiles:
            return "tiles"
        if pairs:
            return "pair_blocks"
        if fp32_narrow and weight_dtype == "auto" and exact_in_bf16():
            return "bf16_blocks"
        if invariant:
            if narrow:
                return "fp32_blocks" if dtype == torch.float32 else "bf16_blocks"
            return "triton" if device.type == "cuda" else "chunked"
        if onednn:
            return "onednn"
        if choice is None:
            return "plain"
        raise ValueError("weight prepacking needs fp32/bf16 on a CPU build with oneDNN (mkldnn)")
    if choice not in WEIGHT_LAYOUTS:
        raise ValueError(f"prepack_weights must be a bool, None or one of {WEIGHT_LAYOUTS}")
    if not available[choice]:
        raise ValueError(f"the {choice!r} weight layout is not available for {dtype} on {device}")
    return choice


def exact_in_bf16(matrices) -> bool:
    """Whether every matrix holds only values bf16 represents (stops at the first that does
    not: random fp32 weights fail on their first matrix)."""
    return all(
        m.dtype == torch.bfloat16 or torch.equal(m, m.to(torch.bfloat16).to(m.dtype))
        for m in matrices
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x @ weight^T + bias`` with a plain weight."""
    return F.linear(x, weight, bias)


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + x @ weight^T`` in one call (addmm), a plain weight."""
    return torch.addmm(residual, x, weight.t())


def prepack(weight: torch.Tensor, batch_hint: int = 8) -> torch.Tensor:
    """A ``[out, in]`` weight in oneDNN's blocked layout, so no matmul reorders it per call.

    The hint only picks the layout; any number of input rows works.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x @ weight^T + bias`` with a weight from ``prepack``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def packed_linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor):
    """``residual + x @ weight^T`` in one call, a weight from ``prepack``."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, None, "add")


def tile_linear(x: torch.Tensor, weight: TileWeight, bias: torch.Tensor | None = None):
    """``x @ weight^T + bias`` with a weight from ``kernels.cpu.tile_linear.pack_tile_weight``."""
    return _tile_linear(x, weight, bias)


def tile_linear_add(x: torch.Tensor, weight: TileWeight, residual: torch.Tensor):
    """``residual + x @ weight^T`` in one call, a tile-packed weight."""
    return _tile_linear(x, weight, None, residual)


def pair_linear(x: torch.Tensor, weight: PairWeight, bias: torch.Tensor | None = None):
    """``x @ weight^T + bias`` with a weight from ``kernels.cpu.pair_linear.pack_pair_weight``."""
    return _pair_linear(x, weight, bias)


def pair_linear_add(x: torch.Tensor, weight: PairWeight, residual: torch.Tensor):
    """``residual + x @ weight^T`` in one call, a pair-packed weight."""
    return _pair_linear(x, weight, None, residual)


def narrow_linear(x: torch.Tensor, weight: NarrowWeight, bias: torch.Tensor | None = None):
    """``x @ weight^T + bias`` with a weight from ``kernels.cpu.narrow_linear``'s packers; a
    bf16 ``x`` (a bf16 model) is summed in fp32 and the result rounded once, as the tile
    linears round."""
    if x.dtype == torch.bfloat16:
        wide_bias = None if bias is None else bias.float()
        return _narrow_linear(x.float(), weight, wide_bias).to(torch.bfloat16)
    return _narrow_linear(x, weight, bias)


def narrow_linear_add(x: torch.Tensor, weight: NarrowWeight, residual: torch.Tensor):
    """``residual + x @ weight^T`` in one call, a narrow-stored weight (bf16 as above)."""
    if x.dtype == torch.bfloat16:
        return _narrow_linear(x.float(), weight, None, residual.float()).to(torch.bfloat16)
    return _narrow_linear(x, weight, None, residual)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x @ weight^T + bias`` in ``kernels.matmul`` (CUDA)."""
    return _triton_matmul(x, weight, bias)


def triton_linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor):
    """``residual + x @ weight^T`` in one ``kernels.matmul`` launch."""
    return _triton_matmul(x, weight, None, residual)


def pack_columns(weight: torch.Tensor) -> torch.Tensor:
    """The chunked layout's matrix: the same ``[out, in]`` matrix, stored column by column
    (its transpose contiguous) where torch's batched matmul reads that faster and sums
    each row the same way (``columns_pay``), else as loaded."""
    if weight.device.type == "cpu" and columns_pay(weight.dtype):
        return weight.t().contiguous().t()
    return weight


def columns_pay(dtype: torch.dtype) -> bool:
    """Whether the chunked layout stores ``dtype`` matrices column by column: bf16 where
    oneDNN runs bf16.

    There torch 2.13's ``bmm`` over a transposed view of a bf16 matrix takes a slow path:
    a 16-row chunk through SmolLM2's 576 x 49,152 head took 161 ms against 6.3 ms over
    the contiguous transpose, with the same bits (docs/kernels.md). Where
    oneDNN does not run bf16 (an AVX2 CPU) the contiguous transpose is the slow one and
    sums differently. fp32 measured the same bits both ways and no step faster on the
    AVX2 build; it stays as loaded (a tied head would take a second copy), as does fp16.
    """
    return dtype == torch.bfloat16 and _onednn_runs_bf16()


def _chunked_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` as one batched matmul of ``CHUNK_ROWS``-row chunks (the last padded
    with zeros), so every product torch computes has the same shape."""
    rows, k = x.shape
    pad = -rows % CHUNK_ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, k)])
    chunks = x.view(-1, CHUNK_ROWS, k)  # [C, 16, K]
    out = torch.bmm(chunks, weight.t().expand(chunks.shape[0], k, weight.shape[0]))
    return out.view(-1, weight.shape[0])[:rows]


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``x @ weight^T + bias``, each row summed the same way whatever the row count."""
    out = _chunked_matmul(x, weight)
    return out if bias is None else out + bias


def chunked_linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor):
    """``residual + x @ weight^T``, each row summed the same way whatever the row count."""
    return residual + _chunked_matmul(x, weight)


def _plain(weight: torch.Tensor) -> torch.Tensor:
    return weight


LINEARS = {
    "plain": Linears("plain", _plain, linear, linear_add),
    "onednn": Linears("onednn", prepack, packed_linear, packed_linear_add),
    "tiles": Linears("tiles", pack_tile_weight, tile_linear, tile_linear_add),
    "pair_blocks": Linears("pair_blocks", pack_pair_weight, pair_linear, pair_linear_add),
    "bf16_blocks": Linears("bf16_blocks", pack_bf16_weight, narrow_linear, narrow_linear_add),
    "int8_blocks": Linears("int8_blocks", pack_int8_weight, narrow_linear, narrow_linear_add),
    "fp32_blocks": Linears("fp32_blocks", pack_fp32_weight, narrow_linear, narrow_linear_add),
    "chunked": Linears("chunked", pack_columns, chunked_linear, chunked_linear_add),
    "triton": Linears("triton", _plain, triton_linear, triton_linear_add),
}
