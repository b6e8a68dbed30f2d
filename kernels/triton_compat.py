"""Triton where it is installed; a stand-in that keeps the torch path importable where not.

pyproject installs triton on Linux only. Without it the kernel modules still
import (their ``@triton.jit`` functions stay plain functions that are never
launched), the torch references run as usual, and asking for the triton
backend raises ``ValueError`` (``runnable``). ``runnable`` and ``dot_dtype`` are
what every Triton launcher asks before a launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    class _TritonStandIn:
        """The few names the kernel modules use at import and launch-setup time."""

        @staticmethod
        def jit(fn: Callable | None = None, **_options: Any) -> Any:
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 1 << (n - 1).bit_length()

    class _LanguageStandIn:
        @staticmethod
        def constexpr(value: Any) -> Any:
            return value

    triton = _TritonStandIn()
    tl = _LanguageStandIn()

__all__ = ["HAS_TRITON", "dot_dtype", "runnable", "tl", "triton"]


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
