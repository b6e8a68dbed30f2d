"""Paged-attention and KV-cache kernels: Triton on CUDA, C loops or the torch reference on CPU.

Which kernel runs is decided in one place, ``kernels.backend.choose_kernels``, and
reached two ways. A forward step binds the chosen backend's kernels once for all of
its layers (``kernels.step.bind.bind_step``, the model's way in). The per-op functions
below are thin wrappers for every other caller (tests, references, the engine's block
copies): each checks its arguments, asks ``choose_kernels`` for the same
``KernelChoice`` a step would get on such tensors, and runs that backend's kernel.

Public API (signatures fixed in docs/contracts.md)::

    write_kv(k_cache, v_cache, key, value, slot_mapping)
    paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale) -> out
    paged_extend_attention(query, k_cache, v_cache, block_tables, query_start_loc,
                           context_lens, scale) -> out
    copy_blocks(src_pool, dst_pool, pairs)
    rms_norm(x, weight, eps) -> out
    apply_rope_(x, cos, sin)
    swiglu(gate_up) -> out

Every function also takes, by keyword (the last three only ``backend``; ``invariant``
only the attention):

- ``backend``: ``"auto"`` (Triton when the tensors are on CUDA; on the CPU the
  native C kernels where they build, else the torch reference), ``"torch"``,
  ``"native"`` (C loops: attention of short query runs, the KV write and the
  element-wise layers; torch for the rest) or ``"triton"`` (on CPU tensors:
  Triton's interpreter, for tests; RMSNorm runs its Triton kernel, RoPE and SwiGLU
  their torch code). ``CHATSVC_KERNEL_BACKEND`` sets the default (see ``kernels.backend``).
- ``invariant`` (the attention's): see ``kernels.invariance``; with it the torch path
  runs ``kernels.span_attention`` and Triton ``kernels.span_attention_triton``.
- ``check_bounds``: value-range checks of the index tensors (block ids, slots,
  context lengths); on by default. They read the index tensors, which is a
  host sync on CUDA, so a hot path fed by the trusted cache manager may turn
  them off. Shape, dtype and device checks always run.

- A KV cache may be narrower than the model: bf16 for an fp32 model (``write_kv`` rounds
  each value to nearest even; the attention widens it as it reads), or int8 below.
- ``scales``: for an int8 KV cache (``kernels.kv_layout``: int8 rows with a scale per
  token and head), the caches' scale views (``KVScales``; ``kv_layout.layer_kv`` splits a
  layer of the pool into both). ``write_kv`` quantizes on every backend; the attention
  reads narrower caches on every backend (Triton's invariant kernels only: with
  ``invariant=False`` the triton backend raises ``ValueError``).

Bad input raises ``ValueError`` before any memory is touched.
"""

from __future__ import annotations

import torch

from kernels.attention_inputs import AttentionInputs
from kernels.backend import KernelChoice, choose_kernels
from kernels.copy_blocks import check_copy_blocks, copy_blocks_torch, copy_blocks_triton
from kernels.cpu.attention import paged_extend_attention_native
from kernels.decode_attention import check_decode, paged_decode_attention_triton
from kernels.extend_attention import (
    check_extend,
    paged_extend_attention_torch,
    paged_extend_attention_triton,
)
from kernels.extend_metadata import ExtendMetadata, check_extend_metadata
from kernels.kv_layout import KVScales, is_narrowed
from kernels.rms_norm import rms_norm
from kernels.rope import apply_rope_
from kernels.span_attention import paged_attention_spans
from kernels.span_attention_triton import paged_attention_spans_triton
from kernels.span_metadata import SpanMetadata, check_span_metadata
from kernels.step.write_index import WriteIndex, check_write_index
from kernels.swiglu import swiglu
from kernels.validate import check_kv_scales
from kernels.write_kv import check_write_kv, write_kv_native, write_kv_torch, write_kv_triton

__all__ = [
    "apply_rope_",
    "copy_blocks",
    "paged_decode_attention",
    "paged_extend_attention",
    "rms_norm",
    "swiglu",
    "write_kv",
]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
    check_bounds: bool = True,
    index: WriteIndex | None = None,
    scales: KVScales | None = None,
) -> None:
    """Store ``key``/``value`` ``[T, H_kv, D]`` into slots ``slot_mapping [T]`` (-1 = skip).

    ``k_cache``/``v_cache`` are one layer's ``[num_blocks, block_size, H_kv, D]``
    views of the pool, written in place (an int8 cache: quantized rows, their scales
    into ``scales``). Slots must be distinct. ``index``
    (``kernels.step.write_index.write_index`` of the same slots) spares the torch
    path re-deriving it in every layer; Triton and native ignore it.
    """
    check_write_kv(k_cache, v_cache, key, value, slot_mapping, check_bounds, scales)
    chosen = choose_kernels(k_cache.device, key.dtype, backend=backend).backend
    if chosen == "triton":
        write_kv_triton(k_cache, v_cache, key, value, slot_mapping, scales)
        return
    if index is not None:
        check_write_index(index, key.shape[0], k_cache.shape[1])
    if chosen == "native":
        write_kv_native(k_cache, v_cache, key, value, slot_mapping, scales=scales)
        return
    write_kv_torch(k_cache, v_cache, key, value, slot_mapping, index, scales)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    backend: str | None = None,
    check_bounds: bool = True,
    partition_size: int | None = None,
    metadata: ExtendMetadata | SpanMetadata | None = None,
    invariant: bool = True,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    query ``[B, H_q, D]``; block_tables ``[B, max_blocks]``; context_lens ``[B]``
    (tokens of each sequence including the new one, whose K/V is already
    written); returns ``[B, H_q, D]`` in the query's dtype. ``partition_size``
    forces the Triton split-context path (tokens per program; not with ``invariant``,
    whose splits are the fixed spans). ``metadata`` (the CPU path's per-step plan of
    the same tables and lengths, one new token per sequence: see ``_check_metadata``)
    spares the CPU paths rebuilding it per layer; Triton ignores it. On the CPU a decode
    runs the extend kernels with one new token per sequence
    (``AttentionInputs.one_token_each``). ``invariant``: see ``kernels.invariance``.
    """
    inputs = AttentionInputs(query, k_cache, v_cache, block_tables, None, context_lens, scale)
    check_decode(inputs, check_bounds)
    check_kv_scales(k_cache, scales)
    choice = choose_kernels(
        query.device, query.dtype, query.shape[-1], backend, invariant, k_cache.dtype
    )
    if choice.backend == "triton":
        if not choice.invariant:
            return paged_decode_attention_triton(inputs, partition_size)
        if partition_size is not None:
            raise ValueError("partition_size applies with invariant=False (spans are fixed)")
        decode = inputs.one_token_each()
        return paged_attention_spans_triton(decode, max_query_len=1, scales=scales)
    return _attention_on_cpu(inputs.one_token_each(), choice, metadata, scales)


def paged_extend_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    backend: str | None = None,
    check_bounds: bool = True,
    max_query_len: int | None = None,
    metadata: ExtendMetadata | SpanMetadata | None = None,
    invariant: bool = True,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """Causal attention of new-token chunks over their cached prefix and themselves.

    query ``[T, H_q, D]`` holds the new tokens of B sequences, sequence b in rows
    ``query_start_loc[b]:query_start_loc[b + 1]``; context_lens ``[B]`` counts each
    sequence's tokens including the new ones (already written). Returns
    ``[T, H_q, D]``. ``max_query_len`` spares the Triton path a host sync.
    ``metadata`` (the CPU path's per-step plan of the same step: see
    ``_check_metadata``) spares the CPU paths rebuilding it per layer; Triton
    ignores it. ``invariant``: see ``kernels.invariance``.
    """
    inputs = AttentionInputs(
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale
    )
    check_extend(inputs, check_bounds)
    check_kv_scales(k_cache, scales)
    choice = choose_kernels(
        query.device, query.dtype, query.shape[-1], backend, invariant, k_cache.dtype
    )
    if choice.backend == "triton":
        if choice.invariant:
            return paged_attention_spans_triton(inputs, max_query_len, scales=scales)
        return paged_extend_attention_triton(inputs, max_query_len)
    return _attention_on_cpu(inputs, choice, metadata, scales)


def _attention_on_cpu(
    inputs: AttentionInputs,
    choice: KernelChoice,
    metadata: ExtendMetadata | SpanMetadata | None,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """The native or torch path of checked inputs that have their start tensor."""
    _check_metadata(metadata, inputs, choice)
    if choice.backend == "native":
        return paged_extend_attention_native(inputs, metadata, choice.invariant, scales)
    if is_narrowed(inputs.k_cache.dtype, inputs.query.dtype):
        # The span tasks widen what they gather; the groups read the query's dtype.
        plan = metadata if isinstance(metadata, SpanMetadata) else None
        return paged_attention_spans(inputs, plan, scales)
    if choice.invariant:
        return paged_attention_spans(inputs, metadata)
    return paged_extend_attention_torch(inputs, metadata)


def _check_metadata(
    metadata: ExtendMetadata | SpanMetadata | None, inputs: AttentionInputs, choice: KernelChoice
) -> None:
    """A CPU path's plan: the invariant torch path's ``kernels.span_metadata.span_metadata``,
    the others' ``kernels.extend_metadata.extend_metadata``."""
    if metadata is None:
        return
    query, k_cache = inputs.query, inputs.k_cache
    if choice.backend == "torch" and choice.invariant:
        check_span_metadata(
            metadata,
            query.shape[0],
            inputs.context_lens.shape[0],
            k_cache.shape[1],
            query.shape[1] // k_cache.shape[2],
        )
        return
    check_extend_metadata(
        metadata,
        query.shape[0],
        inputs.context_lens.shape[0],
        k_cache.shape[1],
        query.shape[1] // k_cache.shape[2],
        choice.backend == "native",
    )


def copy_blocks(
    src_pool: torch.Tensor,
    dst_pool: torch.Tensor,
    pairs: torch.Tensor,
    *,
    backend: str | None = None,
    check_bounds: bool = True,
) -> None:
    """Copy whole blocks: ``dst_pool[d] = src_pool[s]`` for each ``(s, d)`` in ``pairs [N, 2]``.

    Pools are whole tiers ``[num_blocks, ...]`` (``src_pool`` may be ``dst_pool``:
    copy-on-write). Pools on two devices (tier swaps) always take the torch path
    (asynchronous block copies); see ``kernels.copy_blocks``.
    """
    check_copy_blocks(src_pool, dst_pool, pairs, check_bounds)
    chosen = choose_kernels(src_pool.device, src_pool.dtype, backend=backend).backend
    if chosen == "triton" and src_pool.device == dst_pool.device:
        copy_blocks_triton(src_pool, dst_pool, pairs)
    else:
        copy_blocks_torch(src_pool, dst_pool, pairs)
