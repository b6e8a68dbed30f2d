"""A step on the torch backend: the torch references, with the step's metadata built once.

Every layer writes to the same slots and attends over the same tables, so the split
of slots into (block, offset) (``kernels.step.write_index.write_index``) and the
attention's plan are built here once for all layers. In invariant steps (the default,
``kernels.invariance``) the plan is the fixed-shape span tasks of
``kernels.span_metadata``; otherwise the padded SDPA groups of
``kernels.extend_metadata`` (a decode is the step whose sequences all have one new
token: the groups then hold decodes only, with one key mask per sequence). A pool
narrower than the model (int8, or bf16 under fp32: ``kernels.kv_layout``) takes the span
tasks in either mode: they widen what they gather, the groups read the model's dtype.
"""

from __future__ import annotations

import torch

from kernels.backend import KernelChoice
from kernels.extend_attention import attend_groups
from kernels.extend_metadata import ExtendMetadata, extend_metadata
from kernels.kv_layout import is_narrowed
from kernels.rms_norm import rms_norm_torch
from kernels.rope import apply_rope_torch
from kernels.span_attention import attend_spans
from kernels.span_metadata import SpanMetadata, span_metadata
from kernels.step.ops import StepBatch, StepDims, StepOps
from kernels.step.write_index import WriteIndex, write_index
from kernels.swiglu import swiglu_torch
from kernels.write_kv import write_kv_torch


class TorchStep(StepOps):
    """See the module docstring; built by ``kernels.step.bind.bind_step``."""

    backend = "torch"

    def __init__(
        self, batch: StepBatch, kv_pool: torch.Tensor, dims: StepDims, choice: KernelChoice
    ) -> None:
        super().__init__(batch, kv_pool, dims)
        num_kv_heads, head_dim = kv_pool.shape[4], kv_pool.shape[5]
        group = dims.num_q_heads // num_kv_heads
        tables, starts, lens = batch.block_tables, batch.query_start_loc, batch.context_lens
        self.metadata: ExtendMetadata | SpanMetadata
        # The groups read caches of the model's dtype; the span tasks widen narrower ones.
        if choice.invariant or is_narrowed(kv_pool.dtype, self.dtype):
            self.metadata = span_metadata(tables, starts, lens, kv_pool.shape[3], group)
        else:
            row_bytes = num_kv_heads * head_dim * kv_pool.element_size()
            self.metadata = extend_metadata(
                tables, starts, lens, kv_pool.shape[3], group, row_bytes, kv_pool.dtype
            )
        self.write_index: WriteIndex = write_index(batch.slot_mapping, kv_pool.shape[3])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm_torch(x, weight, self.eps)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.check_rows(x, "rope_")
        apply_rope_torch(x, cos, sin)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu_torch(gate_up)

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.check_kv(key, value)
        k_cache, v_cache, scales = self.layer_kv(layer)
        slots, index = self.batch.slot_mapping, self.write_index
        write_kv_torch(k_cache, v_cache, key, value, slots, index, scales)

    def attention(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        self.check_query(query)
        k_cache, v_cache, scales = self.layer_kv(layer)
        if isinstance(self.metadata, SpanMetadata):
            return attend_spans(query, k_cache, v_cache, self.metadata, self.scale, scales)
        out = torch.empty_like(query)
        attend_groups(query, k_cache, v_cache, self.metadata, self.scale, out)
        return out
