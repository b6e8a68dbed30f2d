"""int8 KV rows and their scales (``kv_layout``: an int8 pool): the torch reference.

One row = one token's ``head_dim`` values of one KV head, quantized on its own:

    amax  = max |x|                               (fp32; NaN if any x is NaN)
    scale = amax / 127 in fp32, rounded *up* to bf16    (so |x / scale| <= 127)
    q     = round-half-even(x / scale), in [-127, 127]  (0 where scale is 0 or x / scale
                                                         is NaN)

and read back as ``q * scale``. A row's q and scale depend on that row alone, so a
token's stored bits are the same whatever step wrote it (kernels/invariance.py). The C
write (``kernels/cpu/write_kv.c``) and the Triton one (``kernels/write_kv.py``) compute
the same bits: one fp32 division per value and round-half-even, no reciprocal.

A row holding NaN keeps NaN as its scale (rows of zeros), so a later read sees NaN as
a float cache would have stored it, instead of a finite value that hides the fault.
"""

from __future__ import annotations

import torch

from kernels.kv_layout import QUANT_DTYPE, SCALE_DTYPE

QMAX = 127


def round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x >= 0`` (or NaN) -> the smallest bf16 at least as large (NaN stays NaN)."""
    bits = x.float().view(torch.int32).to(torch.int64)
    up = (bits + 0xFFFF) & 0xFFFF0000
    nan = torch.isnan(x)
    up = torch.where(nan, bits & 0xFFFF0000 | 0x00400000, up)
    return up.to(torch.int32).view(torch.float32).to(SCALE_DTYPE)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` (any float dtype) -> ``(q [..., D] int8, scale [...] bf16)``."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # NaN propagates
    scale = round_up_to_bf16(amax / QMAX)
    s = scale.float().unsqueeze(-1)
    q = torch.round(xf / s)
    q = torch.where((s > 0) & ~torch.isnan(q), q, torch.zeros_like(q))
    return q.clamp_(-QMAX, QMAX).to(QUANT_DTYPE), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``q [..., D]`` int8 with ``scale [...]`` -> values ``q * scale`` in ``dtype``."""
    return (q.to(torch.float64) * scale.to(torch.float64).unsqueeze(-1)).to(dtype)
