"""Which kernels run a forward step: ``bind_step``, the one entry the model calls.

    ops = bind_step(batch, kv_pool, dims)     # once per step
    for each layer:  ops.rms_norm, ops.rope_, ops.write_kv, ops.attention, ops.swiglu

``kernels.backend.choose_kernels`` decides the backend for the pool's device, dtype
and head size (``CHATSVC_KERNEL_BACKEND`` / ``backend=``; see there), and the
backend's module binds the step, building the per-step metadata its kernels want:

    native   native_step.NativeStep   C kernels; attention runs up to the routing limit
                                      in C, longer ones in torch SDPA groups built here
    torch    torch_step.TorchStep     torch references; SDPA groups and the slot split
                                      built here
    triton   triton_step.TritonStep   Triton; decode or extend kernel per step

The public per-op functions in ``kernels`` take the same ``choose_kernels`` decision,
call by call (docs/kernels.md, "Where the decision is").
"""

from __future__ import annotations

import torch

from kernels import backend as backends
from kernels.step.native_step import NativeStep
from kernels.step.ops import StepBatch, StepDims, StepOps
from kernels.step.torch_step import TorchStep
from kernels.step.triton_step import TritonStep

__all__ = ["StepBatch", "StepDims", "StepOps", "bind_step"]

STEP_OPS: dict[str, type[StepOps]] = {
    NativeStep.backend: NativeStep,
    TorchStep.backend: TorchStep,
    TritonStep.backend: TritonStep,
}


def bind_step(
    batch: StepBatch,
    kv_pool: torch.Tensor,
    dims: StepDims,
    backend: str | None = None,
    invariant: bool = True,
) -> StepOps:
    """The kernels of one step over ``kv_pool [N, L, 2, block_size, H_kv, D]`` (the model's
    dtype, bf16 under fp32, or int8 with scales: ``kernels.kv_layout``) for all its layers,
    on ``backend`` (None: the environment's choice, else ``"auto"``); invariant ones
    (``kernels.invariance``) unless ``invariant`` is False.

    ``batch``'s value ranges must have been checked against the pool (the model does,
    once per step); shapes are checked here. Raises ``ValueError`` for a backend that
    cannot run here or a batch that does not fit the pool.
    """
    dtype = dims.dtype or kv_pool.dtype
    choice = backends.choose_kernels(
        kv_pool.device, dtype, kv_pool.shape[-1], backend, invariant, kv_pool.dtype
    )
    return STEP_OPS[choice.backend](batch, kv_pool, dims, choice)
