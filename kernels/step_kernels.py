"""The kernel calls of one forward step, bound once for all of its layers.

Every layer of a step calls the same kernels on tensors of the same shapes and
strides with the same index tensors; only the layer's slice of the pool and the
data differ. The public functions in ``kernels`` check their arguments and
resolve the backend on every call. On the CPU those checks cost more than the
element-wise kernels themselves: a SmolLM2 decode step of 16 sequences over
1,000 tokens took 65.2 ms with them and 58.7 ms with the C kernels called
directly (2 vCPU Xeon, interleaved, docs/engine.md). So a step binds its kernels
once, after the model has checked the batch and the pool, and each layer calls:

    rms_norm(x, weight)   rope_(qk, cos, sin)   swiglu(gate_up)
    write_kv(layer, k, v)                       attention(layer, q)

``NativeStep`` launches the C kernels (``kernels.native``) with the index tensors
converted and the pool's strides read once; ``CheckedStep`` calls the public
functions (torch reference, Triton) with the step's precomputed metadata. Both
give the same results as calling the public functions layer by layer.
"""

from __future__ import annotations

import math

import torch

import kernels
from kernels import native
from kernels.cpu_attention import NATIVE_Q_TILE, native_supports
from kernels.extend_attention import attend_groups
from kernels.extend_metadata import ExtendMetadata, check_extend_metadata
from kernels.kv_layout import layer_views
from kernels.step_metadata import WriteIndex


class CheckedStep:
    """A step through the public kernel functions (any backend; checks in every call)."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        is_decode: bool,
        max_query_len: int,
        scale: float,
        eps: float,
        write_index: WriteIndex | None,
        metadata: ExtendMetadata | None,
    ) -> None:
        self.kv_pool = kv_pool
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.query_start_loc = query_start_loc
        self.context_lens = context_lens
        self.is_decode = is_decode
        self.max_query_len = max_query_len
        self.scale = scale
        self.eps = eps
        self.write_index = write_index
        self.metadata = metadata

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, weight, self.eps)

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        kernels.apply_rope_(x, cos, sin)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.swiglu(gate_up)

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        k_cache, v_cache = layer_views(self.kv_pool, layer)
        kernels.write_kv(
            k_cache,
            v_cache,
            key,
            value,
            self.slot_mapping,
            check_bounds=False,
            index=self.write_index,
        )

    def attention(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = layer_views(self.kv_pool, layer)
        if self.is_decode:
            return kernels.paged_decode_attention(
                query,
                k_cache,
                v_cache,
                self.block_tables,
                self.context_lens,
                self.scale,
                check_bounds=False,
                metadata=self.metadata,
            )
        return kernels.paged_extend_attention(
            query,
            k_cache,
            v_cache,
            self.block_tables,
            self.query_start_loc,
            self.context_lens,
            self.scale,
            check_bounds=False,
            max_query_len=self.max_query_len,
            metadata=self.metadata,
        )


class NativeStep:
    """A step through the C kernels, every argument check done here, once.

    Contract with the caller (the model): per layer it passes tensors of the
    shapes this step was built for, ``x`` / ``gate_up`` 2-D and ``query`` /
    ``key`` / ``value`` 3-D with unit stride on the last axis, in the pool's
    dtype, and layer ids below the pool's layer count. The methods only check
    row counts, which keep a wrong call from addressing memory outside its
    tensors through the index tensors.
    """

    def __init__(
        self,
        kv_pool: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        num_q_heads: int,
        scale: float,
        eps: float,
        metadata: ExtendMetadata,
    ) -> None:
        """kv_pool ``[N, L, 2, block_size, H_kv, D]``; the index tensors as in
        ``kernels.paged_extend_attention`` (bounds already checked by the caller);
        metadata: ``extend_metadata`` of the same step with the native routing."""
        self._lib = native.require()
        head_dim = kv_pool.shape[5]
        if not native_supports(kv_pool.device, kv_pool.dtype, head_dim):
            raise ValueError(
                f"the native kernels take CPU fp32/bf16 pools with head_dim a multiple of 16 "
                f"up to 256, got {kv_pool.device} {kv_pool.dtype} head_dim {head_dim}"
            )
        if kv_pool.dim() != 6 or kv_pool.shape[2] != 2 or kv_pool.stride(5) != 1:
            raise ValueError("kv_pool must be [N, L, 2, block_size, H_kv, D], unit stride on D")
        num_tokens, batch = slot_mapping.shape[0], context_lens.shape[0]
        self.num_kv_heads = kv_pool.shape[4]
        if num_q_heads % self.num_kv_heads:
            raise ValueError(f"H_q ({num_q_heads}) must be a multiple of H_kv")
        self.block_size = kv_pool.shape[3]
        check_extend_metadata(
            metadata,
            num_tokens,
            batch,
            self.block_size,
            num_q_heads // self.num_kv_heads,
            True,
        )
        self.kv_pool = kv_pool
        self.num_tokens = num_tokens
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.scale = scale
        self.eps = eps
        self.metadata = metadata
        self._dtype_code = native.DTYPE_CODES[kv_pool.dtype]
        self._threads = torch.get_num_threads()
        item = kv_pool.element_size()
        self._layer_bytes = kv_pool.stride(1) * item
        self._v_offset = kv_pool.stride(2) * item
        self._kv_strides = (kv_pool.stride(0), kv_pool.stride(3), kv_pool.stride(4))
        # Held here so their pointers stay valid for the step.
        self._slots = slot_mapping.to(torch.int64).contiguous()
        self._tables = block_tables.to(torch.int32).contiguous()
        self._starts = query_start_loc.to(torch.int32).contiguous()
        self._lens = context_lens.to(torch.int32).contiguous()
        self._seqs = metadata.native_seqs.to(torch.int32).contiguous()
        if self._starts.shape[0] != batch + 1 or self._tables.shape[0] != batch:
            raise ValueError("query_start_loc must be [B + 1] and block_tables [B, n]")
        self._scale_log2 = scale * math.log2(math.e)

    def _caches(self, layer: int) -> tuple[int, int]:
        k_ptr = self.kv_pool.data_ptr() + layer * self._layer_bytes
        return k_ptr, k_ptr + self._v_offset

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=x.dtype)
        self._lib.chatsvc_rms_norm(
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            x.shape[0],
            x.shape[1],
            self.eps,
            self._dtype_code,
            self._threads,
        )
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        if x.shape[0] != self.num_tokens or cos.shape[0] != self.num_tokens:
            raise ValueError(f"rope_ of a {self.num_tokens}-token step got {x.shape[0]} rows")
        self._lib.chatsvc_rope(
            x.data_ptr(),
            x.stride(0),
            x.stride(1),
            x.shape[0],
            x.shape[1],
            x.shape[2],
            cos.data_ptr(),
            sin.data_ptr(),
            self._dtype_code,
            self._threads,
        )

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        self._lib.chatsvc_swiglu(
            gate_up.data_ptr(),
            gate_up.stride(0),
            out.data_ptr(),
            out.stride(0),
            rows,
            width // 2,
            self._dtype_code,
            self._threads,
        )
        return out

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if key.shape != (self.num_tokens, self.num_kv_heads, self.head_dim) or (
            value.shape != key.shape
        ):
            raise ValueError(f"write_kv of a {self.num_tokens}-token step got {tuple(key.shape)}")
        k_ptr, v_ptr = self._caches(layer)
        self._lib.chatsvc_write_kv(
            key.data_ptr(),
            key.stride(0),
            key.stride(1),
            value.data_ptr(),
            value.stride(0),
            value.stride(1),
            k_ptr,
            v_ptr,
            *self._kv_strides,
            self._slots.data_ptr(),
            self.num_tokens,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            key.element_size(),
        )

    def attention(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        if query.shape != (self.num_tokens, self.num_q_heads, self.head_dim):
            raise ValueError(
                f"attention of a {self.num_tokens}-token step got {tuple(query.shape)}"
            )
        out = torch.empty_like(query)
        if self._seqs.numel():
            k_ptr, v_ptr = self._caches(layer)
            status = self._lib.chatsvc_paged_attention(
                query.data_ptr(),
                query.stride(0),
                query.stride(1),
                k_ptr,
                v_ptr,
                *self._kv_strides,
                out.data_ptr(),
                out.stride(0),
                out.stride(1),
                self._tables.data_ptr(),
                self._tables.stride(0),
                self._starts.data_ptr(),
                self._lens.data_ptr(),
                self._seqs.data_ptr(),
                self._seqs.numel(),
                self.num_q_heads,
                self.num_kv_heads,
                self.head_dim,
                self.block_size,
                NATIVE_Q_TILE,
                self._scale_log2,
                self._dtype_code,
                self._threads,
            )
            if status != 0:
                raise MemoryError("the native attention kernel could not allocate its scratch")
        if self.metadata.groups:
            k_cache, v_cache = layer_views(self.kv_pool, layer)
            attend_groups(query, k_cache, v_cache, self.metadata, self.scale, out)
        return out
