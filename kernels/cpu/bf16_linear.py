"""Linear layers of fp32 models with bf16-stored weights (AVX2), ``kernels/cpu/bf16_linear.c``.

    out = x @ W^T (+ bias) (+ residual)      x [M, K] fp32, W [N, K] stored bf16, out fp32

On a CPU without native bf16 the model computes in fp32, and a decode step is bound by
reading the weights: kept in bf16 (the checkpoint's own dtype, so nothing is lost for
such checkpoints) a step reads half the bytes. The kernel widens each weight exactly
and sums every output in one fixed order, so a row's output does not depend on the
other rows of the step. The reference twin is ``bf16_linear_reference``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.cpu import native


class Bf16Weight(NamedTuple):
    """A ``[N, K]`` weight in bf16, packed in 16-column blocks; ``shape`` is the weight's own."""

    packed: torch.Tensor  # flat bf16, chatsvc_bf16_linear_packed_elements(N, K)
    shape: tuple[int, int]


def bf16_linear_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``bf16_linear`` runs here: fp32 on a CPU whose native library has AVX2 + FMA."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return False
    lib = native.library()
    return lib is not None and bool(lib.chatsvc_bf16_linear_available())


def pack_bf16_weight(weight: torch.Tensor) -> Bf16Weight:
    """``weight [N, K]`` (a floating CPU tensor) rounded to bf16 and packed."""
    if weight.dim() != 2 or not weight.is_floating_point() or weight.device.type != "cpu":
        raise ValueError(
            f"weights to pack are 2-D floating CPU tensors, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    narrow = weight.to(torch.bfloat16).contiguous()
    lib = native.require()
    n, k = narrow.shape
    packed = torch.empty(lib.chatsvc_bf16_linear_packed_elements(n, k), dtype=torch.bfloat16)
    lib.chatsvc_bf16_linear_pack(narrow.data_ptr(), narrow.stride(0), n, k, packed.data_ptr())
    return Bf16Weight(packed, (n, k))


def _check(x: torch.Tensor, weight: Bf16Weight, bias, residual) -> None:
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(
            f"x must be [M, {k}] fp32 with unit stride along K, got {tuple(x.shape)} {x.dtype}"
        )
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(f"bias must be [{n}] fp32, got {tuple(bias.shape)} {bias.dtype}")
    if residual is not None and (
        residual.shape != (x.shape[0], n) or residual.dtype != x.dtype or residual.stride(1) != 1
    ):
        got = f"{tuple(residual.shape)} {residual.dtype}"
        raise ValueError(f"residual must be [{x.shape[0]}, {n}] fp32, got {got}")


def bf16_linear(
    x: torch.Tensor,
    weight: Bf16Weight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias) (+ residual)`` as a new ``[M, N]`` fp32 tensor."""
    _check(x, weight, bias, residual)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    status = native.require().chatsvc_bf16_linear(
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
        raise RuntimeError("the bf16-weight linear kernel needs a build with AVX2 and FMA")
    return out


def bf16_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin: the same sum through torch, in fp32 with the weight rounded to bf16."""
    out = F.linear(x, weight.to(torch.bfloat16).float(), bias)
    return out if residual is None else out + residual
