"""How many intra-op threads torch uses for serving (process-wide)."""

from __future__ import annotations

import os

import torch


def set_torch_threads(num_threads: int | None) -> int:
    """Apply the config's thread count, else OMP_NUM_THREADS, else one per core.

    On a CPU shared with other busy processes 1 thread can be far faster than 2:
    OpenMP threads wait at every barrier for a descheduled peer (docs/engine.md).
    Returns the count in effect.
    """
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    if num_threads:
        torch.set_num_threads(num_threads)
    elif not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(os.cpu_count() or 1)
    return torch.get_num_threads()
