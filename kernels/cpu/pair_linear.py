"""Linear layers of bf16 models on CPUs with AVX512-BF16 but no tile unit,
``kernels/cpu/pair_linear.c``.

    out = x @ W^T (+ bias) (+ residual)      x [M, K], W [N, K], out [M, N], bf16

Where the CPU has AVX512-BF16 but no tile unit (AMD Zen 4, say), its dot-pair
instruction multiplies two bf16 inputs per fp32 lane: a weight is packed once
(``pack_pair_weight``) in 16-column blocks of input pairs, and every output is summed in
one fixed order, so a row's output does not depend on the other rows of the step
(``kernels.invariance``), which torch's oneDNN linears do not promise. The reference twin
is ``pair_linear_reference``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.cpu import native
from kernels.validate import check_linear_inputs


class PairWeight(NamedTuple):
    """A ``[N, K]`` bf16 weight in 16-column blocks of input pairs; ``shape`` is its own."""

    packed: torch.Tensor  # flat bf16, chatsvc_pair_linear_packed_elements(N, K)
    shape: tuple[int, int]


def pair_linear_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``pair_linear`` runs here: bf16 on a CPU whose native library has AVX512-BF16."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return False
    lib = native.library()
    return lib is not None and bool(lib.chatsvc_pair_linear_available())


def pack_pair_weight(weight: torch.Tensor) -> PairWeight:
    """``weight [N, K]`` (a floating CPU tensor) rounded to bf16 and packed."""
    if weight.dim() != 2 or not weight.is_floating_point() or weight.device.type != "cpu":
        raise ValueError(
            f"weights to pack are 2-D floating CPU tensors, got {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}"
        )
    narrow = weight.to(torch.bfloat16).contiguous()
    lib = native.require()
    n, k = narrow.shape
    packed = torch.empty(lib.chatsvc_pair_linear_packed_elements(n, k), dtype=torch.bfloat16)
    lib.chatsvc_pair_linear_pack(narrow.data_ptr(), narrow.stride(0), n, k, packed.data_ptr())
    return PairWeight(packed, (n, k))


def pair_linear(
    x: torch.Tensor,
    weight: PairWeight,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T (+ bias) (+ residual)`` as a new ``[M, N]`` bf16 tensor."""
    check_linear_inputs(x, weight.shape, torch.bfloat16, bias, residual)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)
    status = native.require().chatsvc_pair_linear(
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
        raise RuntimeError("the pair linear kernel did not run: a build without AVX512-BF16")
    return out


def pair_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The twin: the same sum through torch in fp32 with the weight rounded to bf16, bias
    and residual added in fp32, one rounding to bf16."""
    out = F.linear(x.float(), weight.to(torch.bfloat16).float())
    if bias is not None:
        out = out + bias.float()
    if residual is not None:
        out = out + residual.float()
    return out.to(torch.bfloat16)
