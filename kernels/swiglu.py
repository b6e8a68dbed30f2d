"""The SwiGLU gate: ``silu(gate) * up`` from a fused ``[T, 2 * I]`` projection.

On the native backend (``kernels.backend``) the C loop in ``kernels/cpu/layers.c``;
elsewhere, and as its reference, ``swiglu_torch``: silu in fp32 as ``g / (1 + exp(-g))``,
rounded to the input's dtype, times ``up``.

Why not ``F.silu``: its fp32 kernel computes the scalar tail of a vector loop with
another formula than the body, and with several threads a row's elements fall in the
body or the tail by where a thread's range cuts the tensor, so an element's bits
followed the row count and the thread count (measured: a few elements in 60 rows of
1,000). Here every step is an IEEE operation rounded once per element (negate, add,
divide, multiply) or torch's ``exp``, which runs one formula for every element (MKL's
vector exp, whole vectors or masked ones): a row's bits are its own
(``tests/kernels/test_layer_invariance.py``).
"""

from __future__ import annotations

import ctypes

import torch

from kernels.backend import choose_kernels
from kernels.cpu import native


def swiglu_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    g = gate.float()
    silu = g.neg().exp_().add_(1.0)
    torch.div(g, silu, out=silu)
    return silu.to(gate.dtype).mul_(up)


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
