"""A step on the triton backend (CUDA; CPU tensors under Triton's interpreter).

Triton's kernels read the step's raw index tensors themselves, so no metadata is
built. In invariant steps (the default, ``kernels.invariance``) every step, decode or
not, runs the span kernel (``kernels.span_attention_triton``: fixed programs, keys cut
at the fixed spans, merged in span order) and RMSNorm its Triton kernel (one program
per row). Otherwise a decode step (every sequence one new token) runs the decode
kernel, which splits long contexts across programs by the batch (flash-decoding), and
other steps the extend kernel. The grids are sized by the batch's ``max_query_len``
(no host sync). RoPE and SwiGLU run their torch code: element-wise, each element
computed alike wherever it sits.
"""

from __future__ import annotations

import torch

from kernels.attention_inputs import AttentionInputs
from kernels.backend import KernelChoice
from kernels.decode_attention import paged_decode_attention_triton
from kernels.extend_attention import paged_extend_attention_triton
from kernels.rms_norm import rms_norm_torch, rms_norm_triton
from kernels.rope import apply_rope_torch
from kernels.span_attention_triton import paged_attention_spans_triton
from kernels.step.ops import StepBatch, StepDims, StepOps
from kernels.swiglu import swiglu_torch
from kernels.write_kv import write_kv_triton


class TritonStep(StepOps):
    """See the module docstring; built by ``kernels.step.bind.bind_step``."""

    backend = "triton"

    def __init__(
        self, batch: StepBatch, kv_pool: torch.Tensor, dims: StepDims, choice: KernelChoice
    ) -> None:
        super().__init__(batch, kv_pool, dims)
        self.invariant = choice.invariant
        self._starts = None if batch.is_decode and not choice.invariant else batch.query_start_loc

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return rms_norm_triton(x, weight, self.eps)
        return rms_norm_torch(x, weight, self.eps)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.check_rows(x, "rope_")
        apply_rope_torch(x, cos, sin)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu_torch(gate_up)

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.check_kv(key, value)
        k_cache, v_cache, scales = self.layer_kv(layer)
        write_kv_triton(k_cache, v_cache, key, value, self.batch.slot_mapping, scales)

    def attention(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        self.check_query(query)
        k_cache, v_cache, scales = self.layer_kv(layer)
        b = self.batch
        inputs = AttentionInputs(
            query, k_cache, v_cache, b.block_tables, self._starts, b.context_lens, self.scale
        )
        if self.invariant:  # an int8 pool (kernels.kv_layout) is read here only
            return paged_attention_spans_triton(inputs, b.max_query_len, scales=scales)
        if self._starts is None:
            return paged_decode_attention_triton(inputs)
        return paged_extend_attention_triton(inputs, b.max_query_len)
