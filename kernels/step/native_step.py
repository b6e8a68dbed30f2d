"""A step on the native backend: the C kernels (``kernels/cpu/*.c``), called directly.

The public functions resolve the backend and check their arguments in every call,
seven calls per layer; on the CPU that costs more than the element-wise kernels
themselves. Here the library, the team size, the index tensors in the dtypes the C
code reads, and the pool's strides are resolved once per step, and each layer's
call checks its row count and layer id and launches. The step's attention metadata
lists the sequences the C attention takes (up to ``native_max_query`` new tokens)
and groups the longer runs for the torch path's SDPA. An int8 pool (``kernels.kv_layout``)
takes every run to the C attention (the groups read float caches), its scales addressed
like its rows. ``decoder_layers`` runs all of a step's layers in one C call
(``kernels.cpu.decoder``) where the model's matrices are in a native linear's layout.
"""

from __future__ import annotations

import ctypes
import math

import torch

from kernels import invariance
from kernels.backend import KernelChoice, native_takes
from kernels.cpu import decoder, native
from kernels.cpu.attention import NATIVE_Q_TILE, NO_SCALES, launch_attention
from kernels.extend_attention import attend_groups
from kernels.extend_metadata import ExtendMetadata, extend_metadata
from kernels.kv_layout import is_quantized, scale_views
from kernels.rms_norm import rms_norm_native
from kernels.rope import apply_rope_native
from kernels.step.ops import StepBatch, StepDims, StepOps
from kernels.swiglu import swiglu_native
from kernels.write_kv import launch_write_kv, launch_write_kv_int8


class NativeStep(StepOps):
    """See the module docstring; built by ``kernels.step.bind.bind_step``."""

    backend = "native"

    def __init__(
        self, batch: StepBatch, kv_pool: torch.Tensor, dims: StepDims, choice: KernelChoice
    ) -> None:
        super().__init__(batch, kv_pool, dims)
        if not native_takes(kv_pool.device, self.dtype, kv_pool.shape[5], kv_pool.dtype):
            raise ValueError(
                f"the native kernels take CPU fp32/bf16 steps (int8 pools too) with head_dim "
                f"a multiple of 16 up to 256, got {kv_pool.device} {self.dtype} over a "
                f"{kv_pool.dtype} pool, head_dim {kv_pool.shape[5]}"
            )
        num_kv_heads, head_dim = kv_pool.shape[4], kv_pool.shape[5]
        self.metadata: ExtendMetadata = extend_metadata(
            batch.block_tables,
            batch.query_start_loc,
            batch.context_lens,
            kv_pool.shape[3],
            dims.num_q_heads // num_kv_heads,
            num_kv_heads * head_dim * kv_pool.element_size(),
            self.dtype,
            native_max_query=choice.native_max_query,
        )
        self._lib = native.require()
        self._threads = torch.get_num_threads()
        # In the dtypes the C kernels read, once for every layer.
        self._slots = batch.slot_mapping.to(torch.int64).contiguous()
        self._tables = batch.block_tables.to(torch.int32).contiguous()
        self._starts = batch.query_start_loc.to(torch.int32).contiguous()
        self._lens = batch.context_lens.to(torch.int32).contiguous()
        self._seqs = self.metadata.native_seqs.to(torch.int32).contiguous()
        self._span = invariance.SPAN_TOKENS if choice.invariant else 0
        # A layer's K and V by address: the layer views' pointers without the views.
        item = kv_pool.element_size()
        self._layer_bytes, self._v_bytes = kv_pool.stride(1) * item, kv_pool.stride(2) * item
        self._cache_strides = (kv_pool.stride(0), kv_pool.stride(3), kv_pool.stride(4))
        self._kv_code = native.KV_DTYPE_CODES[kv_pool.dtype]
        # An int8 pool's scales: layer 0's views give the strides, the layers lie apart
        # by a fixed step (kv_layout: [L, 2, block_size, H_kv] bf16 in each block).
        self._scales = None
        if is_quantized(kv_pool.dtype):
            k_scale, v_scale = scale_views(kv_pool, 0)
            self._scales = (k_scale.data_ptr(), v_scale.data_ptr() - k_scale.data_ptr())
            self._scale_layer_bytes = 2 * (v_scale.data_ptr() - k_scale.data_ptr())
            self._scale_strides = k_scale.stride()

    def _caches(self, layer: int) -> tuple[int, int]:
        self.check_layer(layer)
        k_ptr = self.kv_pool.data_ptr() + layer * self._layer_bytes
        return k_ptr, k_ptr + self._v_bytes

    def _layer_scales(self, layer: int) -> tuple:
        """The C calls' scale arguments of a layer (``cache_scales``)."""
        if self._scales is None:
            return NO_SCALES
        base, v_offset = self._scales
        k_ptr = base + layer * self._scale_layer_bytes
        return (k_ptr, k_ptr + v_offset, *self._scale_strides)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm_native(x, weight, self.eps, lib=self._lib, num_threads=self._threads)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.check_rows(x, "rope_")
        self.check_rows(cos, "rope_")
        apply_rope_native(x, cos, sin, lib=self._lib, num_threads=self._threads)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return swiglu_native(gate_up, lib=self._lib, num_threads=self._threads)

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.check_kv(key, value)
        block_size = self.kv_pool.shape[3]
        caches = (self._caches(layer), self._cache_strides)
        if self._scales is None:
            kv_dtype = self.kv_pool.dtype
            launch_write_kv(self._lib, key, value, *caches, self._slots, block_size, kv_dtype)
            return
        scales = self._layer_scales(layer)
        launch_write_kv_int8(self._lib, key, value, *caches, scales, self._slots, block_size)

    def attention(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        self.check_query(query)
        out = torch.empty_like(query)
        if self._seqs.numel():
            pool = self.kv_pool
            layout = (
                self._caches(layer),
                self._cache_strides,
                self._layer_scales(layer),
                pool.shape[3],
                pool.shape[4],
            )
            indices = (self._tables, self._starts, self._lens, self._seqs)
            launch_attention(
                self._lib, query, *layout, *indices, self.scale, out, self._span, self._kv_code
            )
        if self.metadata.groups:
            k_cache, v_cache = self.layer_caches(layer)
            attend_groups(query, k_cache, v_cache, self.metadata, self.scale, out)
        return out

    def decoder_layers(
        self,
        weights: decoder.DecoderWeights | None,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor | None:
        """All layers in ``chatsvc_decoder_layers`` (see ``StepOps.decoder_layers``): a step
        in the layers' dtype whose attention is all in C (no SDPA groups), over the pool's
        layers."""
        if (
            weights is None
            or self.metadata.groups
            or self.dtype != weights.dtype
            or weights.num_layers != self.num_layers
        ):
            return None
        pool = self.kv_pool
        num_kv_heads, head_dim = pool.shape[4], pool.shape[5]
        q_size = self.query_shape[1] * head_dim
        if tuple(h.shape) != (self.num_tokens, weights.hidden) or h.dtype != self.dtype:
            raise ValueError(f"decoder_layers of a {self.num_tokens}-token step got {h.shape}")
        if weights.qkv_rows != q_size + 2 * num_kv_heads * head_dim:
            raise ValueError("the layers' qkv rows do not match the pool's heads")
        h = h.contiguous()
        cos = cos.reshape(self.num_tokens, head_dim).contiguous()
        sin = sin.reshape(self.num_tokens, head_dim).contiguous()
        rows = decoder.scratch(weights, self.num_tokens, q_size)
        # An int8 pool's scales: layer 0's K scales, V's distance, a layer's, strides.
        scales = (None, 0, 0, (0, 0, 0))
        if self._scales is not None:
            scales = (*self._scales, self._scale_layer_bytes, self._scale_strides)
        step = decoder.DecoderStep(
            layers=ctypes.addressof(weights.array),
            num_layers=self.num_layers,
            hidden=weights.hidden,
            num_q_heads=self.query_shape[1],
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate=weights.intermediate,
            eps=self.eps,
            scale_log2=self.scale * math.log2(math.e),
            dtype=native.DTYPE_CODES[self.dtype],
            kv=pool.data_ptr(),
            layer_bytes=self._layer_bytes,
            v_bytes=self._v_bytes,
            kv_stride_block=self._cache_strides[0],
            kv_stride_slot=self._cache_strides[1],
            kv_stride_head=self._cache_strides[2],
            block_size=pool.shape[3],
            kv_dtype=self._kv_code,
            scales=scales[0],
            v_scale_bytes=scales[1],
            scale_layer_bytes=scales[2],
            scale_stride_block=scales[3][0],
            scale_stride_slot=scales[3][1],
            scale_stride_head=scales[3][2],
            tokens=self.num_tokens,
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            slots=self._slots.data_ptr(),
            block_tables=self._tables.data_ptr(),
            table_stride=self._tables.stride(0),
            query_start=self._starts.data_ptr(),
            context_lens=self._lens.data_ptr(),
            seqs=self._seqs.data_ptr(),
            num_seqs=self._seqs.numel(),
            q_tile=NATIVE_Q_TILE,
            span=self._span,
            num_threads=self._threads,
            h=h.data_ptr(),
            **{name: t.data_ptr() for name, t in zip(decoder.ROWS, rows, strict=True)},
        )
        decoder.run(self._lib, step)
        return h
