"""The SwiGLU gate: ``silu(gate) * up`` from a fused ``[T, 2 * I]`` projection.

On the native backend (``kernels.backend``) the C loop in ``kernels/cpu/layers.c``;
elsewhere, and as its reference, ``F.silu(gate).mul_(up)``.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels.backend import choose_kernels
from kernels.cpu import native


def swiglu_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def swiglu_native(
    gate_up: torch.Tensor, *, lib: ctypes.CDLL | None = None, num_threads: int | None = None
) -> torch.Tensor:
    """The C loop; ``lib`` / ``num_threads`` as in ``kernels.rms_norm.rms_norm_native``."""
    lib = native.require() if lib is None else lib
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
    lib.chatsvc_swiglu(
        gate_up.data_ptr(),
        gate_up.stride(0),
        out.data_ptr(),
        out.stride(0),
        rows,
        width // 2,
        native.DTYPE_CODES[gate_up.dtype],
        torch.get_num_threads() if num_threads is None else num_threads,
    )
    return out


def swiglu(gate_up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [T, 2 * I]``; returns ``[T, I]``."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2 * I], got {tuple(gate_up.shape)}")
    chosen = choose_kernels(gate_up.device, gate_up.dtype, backend=backend).backend
    if chosen == "native" and gate_up.stride(-1) == 1:  # the C loop's rows
        return swiglu_native(gate_up)
    return swiglu_torch(gate_up)
