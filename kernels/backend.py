"""Backend selection: Triton on CUDA, the native C kernels (else the torch reference) on CPU.

``backend`` is one of ``"auto"`` (default), ``"torch"``, ``"native"`` or
``"triton"``. ``"auto"`` means Triton on CUDA, and on the CPU ``"native"``
where ``kernels.native`` could build its library (``"torch"`` where it could
not). ``"native"`` runs paged attention of short query runs in C
(``kernels.cpu_attention``) and everything else as ``"torch"`` does. The
environment variable ``CHATSVC_KERNEL_BACKEND`` replaces the default of
``"auto"`` for callers that pass nothing (an explicit argument wins).

``"triton"`` with CPU tensors runs the kernels in Triton's interpreter, which
``triton`` only enables when ``TRITON_INTERPRET=1`` is set before it is first
imported (the decorator and Triton's own library functions are bound then).
Tests therefore run the Triton comparisons in a subprocess with that variable
set, and every other caller in the process keeps the torch path on CPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kernels import native
from kernels.triton_compat import HAS_TRITON, tl

BACKENDS = ("auto", "torch", "native", "triton")
ENV_VAR = "CHATSVC_KERNEL_BACKEND"


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Return ``"torch"`` or ``"triton"`` for tensors on ``device``."""
    choice = backend if backend is not None else os.environ.get(ENV_VAR, "auto")
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {choice!r}")
    if choice == "auto":
        if device.type == "cuda":
            return "triton"
        return "native" if device.type == "cpu" and native.library() is not None else "torch"
    if choice == "triton" and device.type not in ("cuda", "cpu"):
        raise ValueError(f"the triton backend runs on CUDA (or CPU, interpreted), not {device}")
    if choice == "native":
        if device.type != "cpu":
            raise ValueError(f"the native backend runs on the CPU, not {device}")
        native.require()
    return choice


def runnable(kernel: Any, device: torch.device) -> Any:
    """The launchable ``@triton.jit`` kernel for tensors on ``device``."""
    if not HAS_TRITON:
        raise ValueError("triton is not installed: use backend='torch'")
    if device.type == "cuda" or type(kernel).__name__ == "InterpretedFunction":
        return kernel
    raise ValueError(
        f"Triton kernels cannot run on {device} tensors unless TRITON_INTERPRET=1 was set "
        "before triton was imported; use backend='torch' (the default on CPU)"
    )


def dot_dtype(tensor: torch.Tensor) -> Any:
    """Operand dtype of ``tl.dot`` in the attention kernels for ``tensor``'s dtype.

    On CUDA: the input dtype (bf16/fp16 tensor cores; fp32 as IEEE fp32). The
    interpreter's ``tl.dot`` mis-handles bf16 operands, so interpreted runs
    upcast them to fp32; the softmax and accumulation are fp32 either way.
    """
    if tensor.device.type != "cuda" or tensor.dtype == torch.float32:
        return tl.float32
    return tl.bfloat16 if tensor.dtype == torch.bfloat16 else tl.float16
