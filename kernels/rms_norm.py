"""RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * weight``.

On the native backend (``kernels.backend``) rows run through the C loop in
``kernels/cpu/layers.c``; on the triton backend through ``rms_norm_kernel``; elsewhere,
and as their reference, ``torch.nn.functional.rms_norm``.

Row invariance of the Triton kernel: one program per row sums its squares in chunks of
``RMS_BLOCK`` columns, one chunk after another, then one tree over the chunk's lanes,
all fixed by the row's length. torch's CUDA reduction picks its blocking (threads per
row, rows per block, a row split over blocks) from the number of rows and columns, so
a row's sum there could change with the step's row count.

Row invariance of the torch path: ``F.rms_norm`` is torch's ``pow``, ``mean``, ``rsqrt``
and ``mul``; the mean's sum is the one reduction. torch runs a reduction of fewer than
``TORCH_GRAIN`` elements on the calling thread, one row after another, each row's sum
in an order fixed by its length; over that, it splits the work over its threads by the
tensor's shape, sometimes inside a row (measured: 5 rows of 40,000 summed otherwise than
each row alone). ``rms_norm_torch`` therefore normalises at most ``TORCH_GRAIN // hidden``
rows per call (``tests/kernels/test_layer_invariance.py``); a row of more elements than
that (no model here has one) is summed alone, its bits then fixed by the thread count.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels.backend import choose_kernels
from kernels.cpu import native
from kernels.triton_compat import runnable, tl, triton

# Columns per chunk of the Triton kernel's sums: fixed, never sized by the call.
RMS_BLOCK = 1024
# torch's at::internal::GRAIN_SIZE: reductions of fewer elements stay on one thread.
TORCH_GRAIN = 32768


@triton.jit
def rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, stride_x, stride_o, hidden, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    squares = tl.zeros([BLOCK], tl.float32)
    for start in range(0, hidden, BLOCK):
        mask = start + cols < hidden
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        squares += x * x
    inv = 1.0 / tl.sqrt_rn(tl.sum(squares, 0) / hidden + eps)
    for start in range(0, hidden, BLOCK):
        mask = start + cols < hidden
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * inv * w
        tl.store(out_ptr + row * stride_o + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


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
    hidden = x.shape[-1]
    per_call = max(1, (TORCH_GRAIN - 1) // max(hidden, 1))
    if x.numel() <= per_call * hidden:
        return F.rms_norm(x, (hidden,), weight, eps)
    rows = x.reshape(-1, hidden)  # each slice's sums on one thread (see above)
    slices = [
        F.rms_norm(rows[i : i + per_call], (hidden,), weight, eps)
        for i in range(0, rows.shape[0], per_call)
    ]
    return torch.cat(slices).view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_kernel`` over the rows of ``x [..., hidden]`` (checked by the caller)."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        runnable(rms_norm_kernel, x.device)[(rows.shape[0],)](
            rows,
            weight.contiguous(),
            out,
            rows.stride(0),
            out.stride(0),
            hidden,
            eps,
            BLOCK=RMS_BLOCK,
        )
    return out.view(x.shape)


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
    if chosen == "triton":
        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)
