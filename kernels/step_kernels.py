"""The kernel calls of one forward step, bound once for all of its layers.

Every layer of a step calls the same kernels on tensors of the same shapes and
strides with the same index tensors; only the layer's slice of the pool and the
data differ. The public functions in ``kernels`` check their arguments and
resolve the backend on every call. On the CPU those checks cost more than the
element-wise kernels themselves: a SmolLM2 decode step of 16 sequences over
1,000 tokens took 65.2 ms with them and 58.7 ms with the C kernels called
directly (2 vCPU Xeon, interleaved, docs/kernels.md). So a step binds its kernels
once, after the model has checked the batch and the pool, and each layer calls:

    rms_norm(x, weight)   rope_(qk, cos, sin)   swiglu(gate_up)
    write_kv(layer, k, v)                       attention(layer, q)

``NativeStep`` calls the C kernels (``*_native``, ``launch_*``) with the library,
the team size, the index tensors and the pool's layout resolved once;
``CheckedStep`` calls the public functions (torch reference, Triton) with the
step's precomputed metadata. Both give the same results as calling the public
functions layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

import kernels
from kernels import native
from kernels.cpu_attention import launch_attention, native_supports
from kernels.extend_attention import attend_groups
from kernels.extend_metadata import ExtendMetadata, check_extend_metadata
from kernels.kv_layout import layer_views
from kernels.rms_norm import rms_norm_native
from kernels.rope import apply_rope_native
from kernels.step_metadata import WriteIndex
from kernels.swiglu import swiglu_native
from kernels.write_kv import launch_write_kv


class StepTensors(NamedTuple):
    """What every layer of a step shares: the pool and the step's index tensors."""

    kv_pool: torch.Tensor  # [N, L, 2, block_size, H_kv, D]
    slot_mapping: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [B, max_blocks]
    query_start_loc: torch.Tensor  # [B + 1]
    context_lens: torch.Tensor  # [B], each sequence's tokens including its new ones


@dataclass
class CheckedStep:
    """A step through the public kernel functions (any backend; checks in every call)."""

    step: StepTensors
    is_decode: bool
    max_query_len: int
    scale: float
    eps: float
    write_index: WriteIndex | None  # the torch path's slot split
    metadata: ExtendMetadata | None  # the CPU paths' attention groups

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, weight, self.eps)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        kernels.apply_rope_(x, cos, sin)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.swiglu(gate_up)

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        k_cache, v_cache = layer_views(self.step.kv_pool, layer)
        kernels.write_kv(
            k_cache,
            v_cache,
            key,
            value,
            self.step.slot_mapping,
            check_bounds=False,
            index=self.write_index,
        )

    def attention(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = layer_views(self.step.kv_pool, layer)
        s = self.step
        if self.is_decode:
            return kernels.paged_decode_attention(
                query,
                k_cache,
                v_cache,
                s.block_tables,
                s.context_lens,
                self.scale,
                check_bounds=False,
                metadata=self.metadata,
            )
        return kernels.paged_extend_attention(
            query,
            k_cache,
            v_cache,
            s.block_tables,
            s.query_start_loc,
            s.context_lens,
            self.scale,
            check_bounds=False,
            max_query_len=self.max_query_len,
            metadata=self.metadata,
        )


class NativeStep:
    """A step through the C kernels, the public functions' checks done here, once.

    Contract with the caller (the model): per layer it passes tensors of the
    shapes this step was built for, ``x`` / ``gate_up`` 2-D and ``query`` /
    ``key`` / ``value`` 3-D with unit stride on the last axis, in the pool's
    dtype. The methods check row counts and layer ids, which keep a wrong call
    from addressing memory outside its tensors through the index tensors.
    """

    def __init__(
        self,
        step: StepTensors,
        *,
        num_q_heads: int,
        scale: float,
        eps: float,
        metadata: ExtendMetadata,
    ) -> None:
        """step: bounds already checked by the caller; metadata: ``extend_metadata``
        of the same step with the native routing (``native_max_query``)."""
        pool = step.kv_pool
        if pool.dim() != 6 or pool.shape[2] != 2 or pool.stride(5) != 1:
            raise ValueError("kv_pool must be [N, L, 2, block_size, H_kv, D], unit stride on D")
        if not native_supports(pool.device, pool.dtype, pool.shape[5]):
            raise ValueError(
                f"the native kernels take CPU fp32/bf16 pools with head_dim a multiple of 16 "
                f"up to 256, got {pool.device} {pool.dtype} head_dim {pool.shape[5]}"
            )
        batch = step.context_lens.shape[0]
        num_kv_heads = pool.shape[4]
        if num_q_heads % num_kv_heads:
            raise ValueError(f"H_q ({num_q_heads}) must be a multiple of H_kv ({num_kv_heads})")
        if step.query_start_loc.shape[0] != batch + 1 or step.block_tables.shape[0] != batch:
            raise ValueError("query_start_loc must be [B + 1] and block_tables [B, n]")
        self.num_tokens = step.slot_mapping.shape[0]
        check_extend_metadata(
            metadata, self.num_tokens, batch, pool.shape[3], num_q_heads // num_kv_heads, True
        )
        self.kv_pool = pool
        self.query_shape = (self.num_tokens, num_q_heads, pool.shape[5])
        self.kv_shape = (self.num_tokens, num_kv_heads, pool.shape[5])
        self.scale = scale
        self.eps = eps
        self.metadata = metadata
        self._lib = native.require()
        self._threads = torch.get_num_threads()
        # In the dtypes the C kernels read, once for every layer.
        self._slots = step.slot_mapping.to(torch.int64).contiguous()
        self._tables = step.block_tables.to(torch.int32).contiguous()
        self._starts = step.query_start_loc.to(torch.int32).contiguous()
        self._lens = step.context_lens.to(torch.int32).contiguous()
        self._seqs = metadata.native_seqs.to(torch.int32).contiguous()
        # A layer's K and V by address: the layer views' pointers without the views.
        item = pool.element_size()
        self._layer_bytes, self._v_bytes = pool.stride(1) * item, pool.stride(2) * item
        self._cache_strides = (pool.stride(0), pool.stride(3), pool.stride(4))

    def _caches(self, layer: int) -> tuple[int, int]:
        if not 0 <= layer < self.kv_pool.shape[1]:
            raise ValueError(f"layer {layer} is outside the pool's {self.kv_pool.shape[1]}")
        k_ptr = self.kv_pool.data_ptr() + layer * self._layer_bytes
        return k_ptr, k_ptr + self._v_bytes

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm_native(x, weight, self.eps, lib=self._lib, num_threads=self._threads)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        if x.shape[0] != self.num_tokens or cos.shape[0] != self.num_tokens:
            raise ValueError(f"rope_ of a {self.num_tokens}-token step got {x.shape[0]} rows")
        apply_rope_native(x, cos, sin, lib=self._lib, num_threads=self._threads)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu_native(gate_up, lib=self._lib, num_threads=self._threads)

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if key.shape != self.kv_shape or value.shape != self.kv_shape:
            raise ValueError(f"write_kv of a {self.num_tokens}-token step got {tuple(key.shape)}")
        block_size = self.kv_pool.shape[3]
        args = (self._caches(layer), self._cache_strides, self._slots, block_size)
        launch_write_kv(self._lib, key, value, *args)

    def attention(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        if query.shape != self.query_shape:
            raise ValueError(
                f"attention of a {self.num_tokens}-token step got {tuple(query.shape)}"
            )
        out = torch.empty_like(query)
        if self._seqs.numel():
            pool = self.kv_pool
            layout = (self._caches(layer), self._cache_strides, pool.shape[3], pool.shape[4])
            indices = (self._tables, self._starts, self._lens, self._seqs)
            launch_attention(self._lib, query, *layout, *indices, self.scale, out)
        if self.metadata.groups:
            k_cache, v_cache = layer_views(self.kv_pool, layer)
            attend_groups(query, k_cache, v_cache, self.metadata, self.scale, out)
        return out
