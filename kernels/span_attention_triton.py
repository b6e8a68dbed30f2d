"""Invariant paged attention in Triton: one kernel for decodes and extends, keys cut at the
fixed spans (the triton path when ``invariant``, ``kernels.invariance``).

The flash-decoding kernels (``decode_attention``, ``extend_attention``) size their
programs by the step: a decode split its context into partitions counted from the batch
and the SM count, an extend program walked keys up to its own last row. Here every
program has one shape, whatever the launch:

    grid = (B, ceil(max_q_len * G / BLOCK_M), max_spans * H_kv)
    program (b, tile, j * H_kv + g): BLOCK_M query rows of sequence b and KV head g
        (row r = new token r // G, query head g * G + r % G) against span j's keys
        [j * SPAN, (j + 1) * SPAN), cut at the context and at the tile's last row,
        in tiles of BLOCK_N keys aligned to position 0 (BLOCK_N divides SPAN)

Per row, an online softmax in fp32 (scale folded into log2 e, exp2):

    s = q . k * scale_log2, keys past the row's position -> -inf
    m' = max(m, max s);  a = exp2(m - m');  p = exp2(s - m')
    l = l * a + sum p;   acc = acc * a + p . V

A row meets the same key tiles in the same order in any launch: the tiles before its
own position are the span's, and the ones a longer tile adds after it are all masked
for it, an exact identity (a = 1, p = 0; V past the context is loaded as zeros, never
read). A row with one span (position < SPAN) writes ``acc / l``; a row with several
writes each span's ``(m, l, acc)``, merged by ``kernels.span_merge`` in span order.

Why a row's bits cannot move on a GPU: ``tl.dot`` computes every output row from its own
q row with the same instruction sequence (tensor-core or FMA, fixed by the constexpr
shapes: BLOCK_M, BLOCK_N, HEAD_DIM, the warps), so neither the other rows of the tile nor
the row's place in it enter its sums; row reductions (``tl.max``, ``tl.sum``) run one
tree per row, fixed by BLOCK_N. Under the interpreter ``tl.dot`` is numpy's matmul at
one fixed shape; the tests check the same property there. The torch twin is
``kernels.span_attention`` (same spans, tolerances of tests/kernels/kernel_cases.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kernels import invariance
from kernels.attention_inputs import AttentionInputs
from kernels.kv_layout import KVScales
from kernels.span_merge import merge_spans
from kernels.triton_compat import dot_dtype, runnable, tl, triton
from kernels.validate import check_shared_strides

_NEG_INIT = tl.constexpr(-1.0e30)


class SpanTiles(NamedTuple):
    """A program's shape: query rows, keys per tile, and the launch's warps and stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Every program on CUDA has this shape, whatever the launch (docs/kernels.md, "Invariance",
# for the H200 figures); under the interpreter, which runs numpy, a smaller one.
CUDA_TILES = SpanTiles(16, 64, 4, 2)
INTERPRETED_TILES = SpanTiles(16, 16, 1, 1)


def span_tiles(device: torch.device) -> SpanTiles:
    """The program shape on ``device``: fixed per device kind, never chosen per launch."""
    return CUDA_TILES if device.type == "cuda" else INTERPRETED_TILES


@triton.jit
def paged_span_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    block_tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    scale_log2,
    max_spans,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    stride_sh,
    stride_bt,
    QUANTIZED: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    LOG2_BLOCK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    span = tl.program_id(2) // NUM_KV_HEADS
    kv_head = tl.program_id(2) % NUM_KV_HEADS
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    context_len = tl.load(context_lens_ptr + b)
    prefix = context_len - q_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len * GROUP
    token = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    q_pos = prefix + token
    # The span's keys this tile reads: up to its last row's position, within the context.
    last_token = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    lo = span * SPAN
    hi = tl.minimum(tl.minimum(context_len, lo + SPAN), prefix + last_token + 1)
    if (tile * BLOCK_M >= q_len * GROUP) | (hi <= lo):
        return

    dims = tl.arange(0, HEAD_DIM)
    row_t = (q_start + token)[:, None]
    q = tl.load(
        q_ptr + row_t * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    ).to(DOT_DTYPE)
    m_i = tl.full([BLOCK_M], _NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + b * stride_bt
    for tile_start in range(lo, hi, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < hi
        block = tl.load(table_row + (pos >> LOG2_BLOCK), mask=pos_mask, other=0).to(tl.int64)
        offset = (pos & ((1 << LOG2_BLOCK) - 1)).to(tl.int64)
        kv_offsets = (block * stride_cb + offset * stride_cs + kv_head * stride_ch)[:, None]
        kv_offsets = kv_offsets + dims[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=pos_mask[:, None], other=0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=pos_mask[:, None], other=0)

        # int8 rows (exact in bf16) times their scales: a key's on its score, a value's
        # folded into its weight; l sums the weights before the values' scales.
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * scale_log2
        if QUANTIZED:
            at = block * stride_sb + offset * stride_ss + kv_head * stride_sh
            k_scale = tl.load(k_scale_ptr + at, mask=pos_mask, other=0.0).to(tl.float32)
            scores = scores * k_scale[None, :]
        visible = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANTIZED:
            v_scale = tl.load(v_scale_ptr + at, mask=pos_mask, other=0.0).to(tl.float32)
            p = p * v_scale[None, :]
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    reached = row_mask & (q_pos >= lo)
    single = q_pos < SPAN  # the row's only span: its output, directly
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(
        out_ptr + row_t * stride_ot + head[:, None] * stride_oh + dims[None, :],
        (acc / safe_l[:, None]).to(out_ptr.dtype.element_ty),
        mask=(reached & single)[:, None],
    )
    part = ((q_start + token).to(tl.int64) * max_spans + span) * (NUM_KV_HEADS * GROUP) + head
    keep = reached & (q_pos >= SPAN)
    tl.store(part_ml_ptr + part * 2, m_i, mask=keep)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=keep)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=keep[:, None])


def paged_attention_spans_triton(
    inputs: AttentionInputs,
    max_query_len: int | None = None,
    span: int | None = None,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """Launch ``paged_span_kernel`` and, for rows with several spans, the merge (inputs
    checked, with their start tensor: a decode's is ``0, 1, ..., B``).

    ``max_query_len`` sizes the grid (None: read from ``query_start_loc``, a host sync on
    CUDA); ``span`` keys per span (None: ``kernels.invariance.SPAN_TOKENS``, read at call
    time), a multiple of the program's BLOCK_N. The span count comes from the table
    width, so the context lengths are never read on the host. ``scales``: an int8
    cache's (``kernels.kv_layout``).
    """
    query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale = inputs
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the triton backend needs a power-of-two head_dim >= 16, got {head_dim}")
    check_shared_strides(k_cache, v_cache)
    span = invariance.SPAN_TOKENS if span is None else span
    tiles = span_tiles(query.device)
    if span <= 0 or span % tiles.block_n:
        raise ValueError(f"span {span} must be a positive multiple of the key tile {tiles.block_n}")
    out = torch.empty_like(query)
    batch = context_lens.shape[0]
    if batch == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out
    group = num_q_heads // num_kv_heads
    max_spans = max(1, -(-block_tables.shape[1] * block_size // span))
    # Partial states of rows with several spans: [T, spans, H_q] x (m, l) and x D.
    f32 = torch.float32
    part_ml = torch.empty(num_tokens, max_spans, num_q_heads, 2, dtype=f32, device=query.device)
    part_acc = torch.empty(
        num_tokens, max_spans, num_q_heads, head_dim, dtype=f32, device=query.device
    )
    block_tables = block_tables.contiguous()
    query_start_loc = query_start_loc.contiguous()
    context_lens = context_lens.contiguous()
    grid = (batch, triton.cdiv(max_query_len * group, tiles.block_m), max_spans * num_kv_heads)
    if scales is not None:
        check_shared_strides(*scales)
    # A float cache's kernel never reads its scale pointers (QUANTIZED is a constant).
    k_scale, v_scale = (k_cache, v_cache) if scales is None else scales
    scale_strides = (0, 0, 0) if scales is None else scales.k.stride()
    runnable(paged_span_kernel, query.device)[grid](
        query,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        out,
        part_acc,
        part_ml,
        block_tables,
        query_start_loc,
        context_lens,
        scale * math.log2(math.e),
        max_spans,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *scale_strides,
        block_tables.stride(0),
        QUANTIZED=scales is not None,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        LOG2_BLOCK=block_size.bit_length() - 1,
        DOT_DTYPE=dot_dtype(query),
        SPAN=span,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if max_spans > 1:
        merge_spans(out, part_acc, part_ml, query_start_loc, context_lens, max_query_len, span)
    return out
