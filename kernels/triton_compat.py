"""Triton where it is installed; a stand-in that keeps the torch path importable where not.

pyproject installs triton on Linux only. Without it the kernel modules still
import (their ``@triton.jit`` functions stay plain functions that are never
launched), the torch references run as usual, and asking for the triton
backend raises ``ValueError`` (``backend.runnable``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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

__all__ = ["HAS_TRITON", "tl", "triton"]
