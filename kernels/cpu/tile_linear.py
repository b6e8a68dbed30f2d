"""Linear layers of bf16 models on the CPU's tile unit (AMX), ``kernels/cpu/tile_linear.c``.

    out = x @ W^T (+ bias) (+ residual)      x [M, K], W [N, K], out [M, N], bf16

The weight is packed once (``pack_tile_weight``) into the layout the tile unit
loads; a step's linears then stream it with one sequential read per thread.
Decode steps are bound by reading the weights, which torch's prepacked oneDNN
linears do more slowly on this project's CPUs (docs/engine.md, ``bench.linear``).
The reference twin is ``tile_linear_reference`` (``torch.nn.functional.linear``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.cpu import native
from kernels.validate import check_linear_inputs


class TileWeight(NamedTuple):
    """A ``[N, K]`` bf16 weight in the tile layout; ``shape`` is the weight's own."""

    packed: torch.Tensor  # flat bf16, chatsvc_linear_packed_elements(N, K)
    shape: tuple[int, int]


def tile_linear_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``tile_linear`` runs here: bf16 on a CPU whose native library has AMX."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    lib = native.library()
    return lib is not None and bool(lib.chatsvc_linear_uses_tiles())


def pack_tile_weight(weight: torch.Tensor) -> TileWeight:
    """``weight [N, K]`` (bf16, CPU, unit stride along K) in the tile layout."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        raise ValueError(
            f"tile weights are 2-D bf16 CPU tensors, got {tuple(weight.shape)} {weight.dtype} "
            f"on {weight.device}"
        )
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    lib = native.require()
    n, k = weight.shape
    packed = torch.empty(lib.chatsvc_linear_packed_elements(n, k), dtype=torch.bfloat16)
    lib.chatsvc_linear_pack(weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr())
    return TileWeight(packed, (n, k))


def tile_linear(
    x: torch.Tensor,
    weight: TileWeight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias) (+ residual)`` as a new ``[M, N]`` bf16 tensor."""
    check_linear_inputs(x, weight.shape, torch.bfloat16, bias, residual)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    status = native.require().chatsvc_linear(
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        weight.packed.data_ptr(),
        weight.shape[0],
        weight.shape[1],
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError("the tile linear kernel found no tile unit or ran out of memory")
    return out


def tile_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin: the same sum with the plain ``[N, K]`` weight, through torch."""
    if residual is None:
        return F.linear(x, weight, bias)
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return (out + residual.float()).to(x.dtype)
