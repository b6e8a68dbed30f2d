"""RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * weight``.

On the native backend (``kernels.backend``) rows run through the C loop in
``kernels/cpu/layers.c``; elsewhere, and as its reference, ``torch.nn.functional.rms_norm``.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels.backend import choose_kernels
from kernels.cpu import native


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``weight`` can scale the last axis of ``x``."""
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"weight must be [hidden] = [{x.shape[-1] if x.dim() else '?'}], "
            f"got {tuple(weight.shape)} for x {tuple(x.shape)}"
        )
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(
            f"weight {weight.dtype} on {weight.device} does not match x {x.dtype} on {x.device}"
        )


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm_native(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    lib: ctypes.CDLL | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:
    """The C loop on rows of ``x`` (``[rows, hidden]``, unit stride along hidden).

    ``lib`` / ``num_threads``: the library and team size, where the caller resolved
    them once (``kernels.step.native_step``); default ``native.require()`` and torch's."""
    lib = native.require() if lib is None else lib
    out = torch.empty(x.shape, dtype=x.dtype)
    weight = weight.contiguous()
    lib.chatsvc_rms_norm(
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        x.shape[0],
        x.shape[1],
        eps,
        native.DTYPE_CODES[x.dtype],
        torch.get_num_threads() if num_threads is None else num_threads,
    )
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str | None = None
) -> torch.Tensor:
    """RMSNorm of ``x [..., hidden]``; returns a new tensor of ``x``'s shape and dtype."""
    check_rms_norm(x, weight)
    chosen = choose_kernels(x.device, x.dtype, backend=backend).backend
    if chosen == "native" and x.dim() == 2 and x.stride(-1) == 1:  # the C loop's rows
        return rms_norm_native(x, weight, eps)
    return rms_norm_torch(x, weight, eps)
