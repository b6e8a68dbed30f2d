"""Paged attention on the CPU through the C kernel (``kernels/cpu_attention.c``).

The native backend (``kernels.backend``) splits a step's sequences:

    new tokens  1 .. native_max_query()  -> the C kernel, blocks read in place
    new tokens  > native_max_query()     -> the torch reference's SDPA groups

Decodes and short new turns are bound by reading K/V, which the torch path
passes over three times (its block gather reads and writes a copy, SDPA reads
it); long prefill chunks are bound by the matrix products, where SDPA's win. Where
the C kernel runs bf16 runs on the CPU's tile unit (AMX) it wins up to ~32 new
tokens; on vector loops alone up to ~6. The torch reference
(``paged_extend_attention_torch``) is this path's oracle in the tests.
"""

from __future__ import annotations

import ctypes
import math

import torch

from kernels import native
from kernels.extend_attention import attend_groups
from kernels.extend_metadata import ExtendMetadata, metadata_for
from kernels.validate import check_shared_strides

# New tokens per sequence up to which the C kernel runs (see the module docstring).
# C / torch time per layer (`python -m bench.cpu_attention`, docs/kernels.md), vector
# loops, 8 sequences over 600 tokens: 0.64 at 2 new tokens, 0.80 at 4, 1.25 at 8, 1.42 at
# 16; one sequence over 1000: 0.69 at 4, 0.90 at 8. They break even at ~6. With the tile
# unit (bf16): one sequence over 1000 0.86 at 32 new tokens, 0.92 at 48; 8 sequences over
# 600 1.07 at 32. They break even at ~32.
NATIVE_MAX_QUERY = 6
NATIVE_MAX_QUERY_TILES = 32
# The kernel's query tile on its vector loops (the tile path takes 16 // G tokens).
NATIVE_Q_TILE = 6


def native_supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the C kernel takes such tensors: on the CPU, fp32 or bf16, a head size
    that is a multiple of 16 (its vector width) up to 256."""
    supported = dtype in native.DTYPE_CODES and head_dim % 16 == 0 and head_dim <= 256
    return device.type == "cpu" and supported


def native_max_query(dtype: torch.dtype, head_dim: int, lib: ctypes.CDLL | None = None) -> int:
    """New tokens per sequence up to which the native backend runs the C kernel."""
    lib = lib if lib is not None else native.library()
    tiles = lib is not None and dtype == torch.bfloat16 and head_dim % 32 == 0
    if tiles and lib.chatsvc_attention_uses_tiles():
        return NATIVE_MAX_QUERY_TILES
    return NATIVE_MAX_QUERY


def paged_attention_native(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    seqs: torch.Tensor,
    out: torch.Tensor,
    lib: ctypes.CDLL | None = None,
) -> None:
    """Write the attention of sequences ``seqs`` (int32 batch indices) into ``out``.

    Arguments as ``kernels.paged_extend_attention`` (already checked there); other
    sequences' rows of ``out`` are left as they are. ``lib``: a library built by
    ``kernels.native`` (default: ``native.library()``).
    """
    if lib is None:
        lib = native.require()
    if not native_supports(query.device, query.dtype, query.shape[-1]):
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
        k_cache.shape[1],
        k_cache.shape[2],
        block_tables.to(torch.int32).contiguous(),
        query_start_loc.to(torch.int32).contiguous(),
        context_lens.to(torch.int32).contiguous(),
        seqs.to(torch.int32).contiguous(),
        scale,
        out,
    )


def launch_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    caches: tuple[int, int],
    cache_strides: tuple[int, int, int],
    block_size: int,
    num_kv_heads: int,
    tables: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    seqs: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """The C call alone: caches by address (K, V) and their shared (block, slot, head)
    strides in elements; the index tensors int32 and contiguous. ``kernels.step_kernels``
    calls it with a step's index tensors converted once."""
    status = lib.chatsvc_paged_attention(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        *caches,
        *cache_strides,
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
        NATIVE_Q_TILE,
        scale * math.log2(math.e),
        native.DTYPE_CODES[query.dtype],
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the native attention kernel could not allocate its scratch memory")


def paged_extend_attention_native(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    metadata: ExtendMetadata | None = None,
) -> torch.Tensor:
    """Short runs through the C kernel, long ones through the torch groups.

    ``metadata`` (built here when None) is ``extend_metadata`` with
    ``native_max_query=native_max_query(...)``, shared by a step's layers.
    """
    if metadata is None:
        limit = native_max_query(query.dtype, query.shape[-1])
        metadata = metadata_for(query, k_cache, block_tables, query_start_loc, context_lens, limit)
    out = torch.empty_like(query)
    paged_attention_native(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        metadata.native_seqs,
        out,
    )
    attend_groups(query, k_cache, v_cache, metadata, scale, out)
    return out
