"""Choosing the compute dtype: bf16 where the hardware runs it natively, else fp32."""

from __future__ import annotations

from functools import lru_cache

import torch

_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
}


@lru_cache(maxsize=1)
def _cpu_has_bf16() -> bool:
    # Without avx512_bf16 / AMX, bf16 matmuls on CPU are emulated and slower than fp32.
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on CUDA with bf16 support or on a CPU with avx512_bf16/AMX; fp32 otherwise."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_bf16() else torch.float32


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str) -> torch.dtype:
    """Turn ``None`` / a name ("bf16", "fp32", ...) / a torch dtype into a floating dtype."""
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str):
        try:
            return _NAMES[dtype.lower()]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_NAMES)}") from None
    if isinstance(dtype, torch.dtype) and dtype in _NAMES.values():
        return dtype
    raise ValueError(f"unsupported dtype {dtype!r}; expected bf16, fp16 or fp32")
