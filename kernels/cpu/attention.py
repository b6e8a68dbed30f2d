"""Paged attention on the CPU through the C kernel (``kernels/cpu/attention*.c``).

In invariant steps (``kernels.invariance``, the default) the C kernel takes every
sequence, its keys cut at the fixed spans, so a token's output is the same in a decode
and in a prefill chunk of any length. Otherwise the native backend splits a step's
sequences (the limit is ``kernels.backend``'s ``native_max_query``):

    new tokens  1 .. native_max_query   -> the C kernel, blocks read in place
    new tokens  > native_max_query      -> the torch reference's SDPA groups

Decodes and short new turns are bound by reading K/V, which the torch path
passes over three times (its block gather reads and writes a copy, SDPA reads
it); long prefill chunks are bound by the matrix products, where SDPA's win. The
torch reference (``paged_extend_attention_torch``) is this path's oracle in the tests.
"""

from __future__ import annotations

import ctypes
import math

import torch

from kernels import invariance
from kernels.attention_inputs import AttentionInputs
from kernels.backend import NATIVE_ALL, native_max_query, native_takes
from kernels.cpu import native
from kernels.extend_attention import attend_groups
from kernels.extend_metadata import ExtendMetadata, metadata_for
from kernels.kv_layout import KVScales
from kernels.validate import check_shared_strides

# The kernel's query tile on its vector loops (the tile path takes 16 // G tokens).
NATIVE_Q_TILE = 6


def paged_attention_native(
    inputs: AttentionInputs,
    seqs: torch.Tensor,
    out: torch.Tensor,
    lib: ctypes.CDLL | None = None,
    span: int | None = None,
    scales: KVScales | None = None,
) -> None:
    """Write the attention of sequences ``seqs`` (int32 batch indices) into ``out``.

    ``inputs`` as ``kernels.paged_extend_attention`` takes them (already checked
    there); other sequences' rows of ``out`` are left as they are. ``lib``: a library
    built by ``kernels.cpu.native`` (default: ``native.library()``). ``span``: keys per
    fixed span (None: ``kernels.invariance.SPAN_TOKENS``, invariant); 0 cuts them by the
    load instead. ``scales``: an int8 cache's row scales (checked by the caller).
    """
    if lib is None:
        lib = native.require()
    query, k_cache, v_cache = inputs.query, inputs.k_cache, inputs.v_cache
    if not native_takes(query.device, query.dtype, query.shape[-1], k_cache.dtype):
        raise ValueError(
            f"the native kernel takes CPU fp32/bf16 tensors with head_dim a multiple of 16 "
            f"up to 256, got {query.device} {query.dtype} head_dim {query.shape[-1]}"
        )
    check_shared_strides(k_cache, v_cache)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError("out must be a query-shaped tensor of the query's dtype")
    if seqs.numel() == 0:
        return
    launch_attention(
        lib,
        query,
        (k_cache.data_ptr(), v_cache.data_ptr()),
        k_cache.stride()[:3],
        cache_scales(scales),
        k_cache.shape[1],
        k_cache.shape[2],
        inputs.block_tables.to(torch.int32).contiguous(),
        inputs.query_start_loc.to(torch.int32).contiguous(),
        inputs.context_lens.to(torch.int32).contiguous(),
        seqs.to(torch.int32).contiguous(),
        inputs.scale,
        out,
        invariance.SPAN_TOKENS if span is None else span,
        native.KV_DTYPE_CODES[k_cache.dtype],
    )


# What the C call takes for a float cache's scales: none.
NO_SCALES = (None, None, 0, 0, 0)


def cache_scales(scales: KVScales | None) -> tuple[int | None, int | None, int, int, int]:
    """An int8 cache's scale views as the C call takes them: addresses (K, V) and their
    shared (block, slot, head) strides; ``NO_SCALES`` for a float cache."""
    if scales is None:
        return NO_SCALES
    k_scale, v_scale = scales
    check_shared_strides(k_scale, v_scale)
    return (k_scale.data_ptr(), v_scale.data_ptr(), *k_scale.stride())


def launch_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    caches: tuple[int, int],
    cache_strides: tuple[int, int, int],
    scales: tuple[int | None, int | None, int, int, int],
    block_size: int,
    num_kv_heads: int,
    tables: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    seqs: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    span: int,
    kv_dtype_code: int,
    q_tile: int = NATIVE_Q_TILE,
) -> None:
    """The C call alone: caches by address (K, V) and their shared (block, slot, head)
    strides in elements, their scales (``cache_scales``) and dtype
    (``native.KV_DTYPE_CODES``); the index tensors int32 and contiguous; ``span`` keys per
    fixed span (0: slices by load); ``q_tile`` new tokens per work item.
    ``kernels.step.native_step`` calls it with a step's index tensors converted once."""
    status = lib.chatsvc_paged_attention(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        *caches,
        *cache_strides,
        *scales,
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        tables.data_ptr(),
        tables.stride(0),
        starts.data_ptr(),
        lens.data_ptr(),
        seqs.data_ptr(),
        seqs.numel(),
        query.shape[1],
        num_kv_heads,
        query.shape[2],
        block_size,
        q_tile,
        span,
        scale * math.log2(math.e),
        native.DTYPE_CODES[query.dtype],
        kv_dtype_code,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the native attention kernel could not allocate its scratch memory")


def paged_extend_attention_native(
    inputs: AttentionInputs,
    metadata: ExtendMetadata | None = None,
    invariant: bool = True,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """Invariant: every run through the C kernel on fixed spans. Otherwise short runs
    through the C kernel, long ones through the torch groups (an int8 cache: every run
    through the C kernel).

    ``metadata`` (built here when None) is ``extend_metadata`` with the native
    routing limit (``kernels.backend``: ``NATIVE_ALL`` when invariant, else
    ``native_max_query``), shared by a step's layers.
    """
    if metadata is None:
        query, kv_dtype = inputs.query, inputs.k_cache.dtype
        limit = (
            NATIVE_ALL
            if invariant
            else native_max_query(query.dtype, query.shape[-1], kv_dtype=kv_dtype)
        )
        metadata = metadata_for(inputs, limit)
    out = torch.empty_like(inputs.query)
    span = invariance.SPAN_TOKENS if invariant else 0
    paged_attention_native(inputs, metadata.native_seqs, out, span=span, scales=scales)
    attend_groups(inputs.query, inputs.k_cache, inputs.v_cache, metadata, inputs.scale, out)
    return out
