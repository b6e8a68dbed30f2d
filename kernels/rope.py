"""Rotary position embedding, in place, in HF's rotate_half layout.

On the native backend (``kernels.backend``) the C loop in ``kernels/cpu/layers.c``;
elsewhere, and as its reference, ``x * cos + rotate_half(x) * sin`` in torch.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.backend import choose_kernels
from kernels.cpu import native


def check_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``cos``/``sin`` hold one ``[D]`` row per token of ``x``."""
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [T, H, D] with D even, got {tuple(x.shape)}")
    expected = (x.shape[0], 1, x.shape[-1])
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != expected or table.dtype != x.dtype or table.device != x.device:
            raise ValueError(
                f"{name} must be {expected} {x.dtype} on {x.device}, got "
                f"{tuple(table.shape)} {table.dtype} on {table.device}"
            )


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    x.mul_(cos).addcmul_(rotated, sin)


def apply_rope_native(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    lib: ctypes.CDLL | None = None,
    num_threads: int | None = None,
) -> None:
    """The C loop; ``lib`` / ``num_threads`` as in ``kernels.rms_norm.rms_norm_native``."""
    lib = native.require() if lib is None else lib
    cos, sin = cos.contiguous(), sin.contiguous()
    lib.chatsvc_rope(
        x.data_ptr(),
        x.stride(0),
        x.stride(1),
        x.shape[0],
        x.shape[1],
        x.shape[2],
        cos.data_ptr(),
        sin.data_ptr(),
        native.DTYPE_CODES[x.dtype],
        torch.get_num_threads() if num_threads is None else num_threads,
    )


def apply_rope_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: str | None = None
) -> None:
    """Rotate ``x [T, H, D]`` in place by ``cos``/``sin`` ``[T, 1, D]`` (both halves of a
    head share an angle). ``x`` may be a strided view, e.g. q and k inside a fused QKV."""
    check_rope(x, cos, sin)
    chosen = choose_kernels(x.device, x.dtype, backend=backend).backend
    if chosen == "native" and x.stride(-1) == 1:  # the C loop's heads
        apply_rope_native(x, cos, sin)
    else:
        apply_rope_torch(x, cos, sin)
