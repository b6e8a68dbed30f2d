"""Paged extend (chunked prefill) attention: new tokens over prefix + themselves.

The new tokens of B sequences sit flat in ``query [T, H_q, D]``; sequence b
owns rows ``query_start_loc[b] : query_start_loc[b + 1]`` (``q_len`` rows).
Its K/V, new tokens included, are already in the cache, so:

    positions   0 ........ prefix-1 | prefix ....... context_len-1
                cached (block table) | new tokens (also in the table)
    new token i sits at prefix + i and attends to positions [0, prefix + i]

Triton algorithm: ``grid = (B, H_q, ceil(max_q_len / BLOCK_M))``; a program
holds BLOCK_M query rows of one head and walks key tiles of BLOCK_N tokens from
position 0 up to its last row's position (later tiles are all masked), with an
online softmax in fp32 and ``tl.dot`` for QK^T and PV. Key tiles are gathered
per token through the block table, so any power-of-two block size works.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.attention_inputs import AttentionInputs
from kernels.extend_metadata import ExtendGroup, ExtendMetadata, metadata_for
from kernels.paged_gather import gather_tokens
from kernels.triton_compat import dot_dtype, runnable, tl, triton
from kernels.validate import (
    check_block_tables,
    check_index,
    check_kv_caches,
    check_query,
    check_scale,
    check_shared_strides,
)

_NEG_INIT = tl.constexpr(-1.0e30)


@triton.jit
def paged_extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_ptr,
    context_lens_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    LOG2_BLOCK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    context_len = tl.load(context_lens_ptr + b)
    prefix = context_len - q_len
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = prefix + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    ).to(DOT_DTYPE)
    # Keys past the tile's last row are masked for every row: stop there.
    # A tile wholly past q_len has nothing to compute.
    hi = tl.minimum(context_len, prefix + (tile + 1) * BLOCK_M)
    hi = tl.where(tile * BLOCK_M < q_len, hi, 0)

    m_i = tl.full([BLOCK_M], _NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + b * stride_bt
    for tile_start in range(0, hi, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < hi
        block = tl.load(table_row + (pos >> LOG2_BLOCK), mask=pos_mask, other=0).to(tl.int64)
        offset = (pos & ((1 << LOG2_BLOCK) - 1)).to(tl.int64)
        row_base = block * stride_cb + offset * stride_cs + kv_head * stride_ch
        kv_offsets = row_base[:, None] + dims[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=pos_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=pos_mask[:, None], other=0.0)

        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * scale_log2
        visible = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee"
        )
        m_i = m_new

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        (acc / safe_l[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None],
    )


def check_extend(inputs: AttentionInputs, check_bounds: bool = True) -> None:
    """Raise ``ValueError`` unless an extend's inputs are consistent."""
    query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale = inputs
    num_blocks, block_size, _, _ = check_kv_caches(k_cache, v_cache)
    check_query(query, k_cache)
    if query.stride(-1) != 1:
        raise ValueError("the head_dim axis of query must be contiguous")
    check_index("block_tables", block_tables, 2, k_cache.device)
    check_index("query_start_loc", query_start_loc, 1, k_cache.device)
    check_index("context_lens", context_lens, 1, k_cache.device)
    batch = context_lens.shape[0]
    if block_tables.shape[0] != batch or query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"batch mismatch: context_lens {batch}, block_tables {block_tables.shape[0]}, "
            f"query_start_loc {query_start_loc.shape[0]} (must be batch + 1)"
        )
    check_scale(scale)
    if not check_bounds or batch == 0:
        return
    starts = query_start_loc.long()
    q_lens = starts[1:] - starts[:-1]
    ends_ok = (starts[0] == 0) & (starts[-1] == query.shape[0])
    if not bool(ends_ok & (q_lens >= 0).all()):  # one host sync when all is well
        first, last = int(starts[0]), int(starts[-1])
        if first != 0 or last != query.shape[0]:
            raise ValueError(
                f"query_start_loc must run from 0 to T = {query.shape[0]}, got {first} .. {last}"
            )
        raise ValueError("query_start_loc must be non-decreasing")
    check_block_tables(block_tables, context_lens, num_blocks, block_size, min_context_lens=q_lens)


def paged_extend_attention_torch(
    inputs: AttentionInputs, metadata: ExtendMetadata | None = None
) -> torch.Tensor:
    """Reference: per group of sequences (``kernels.extend_metadata``), gather whole
    blocks and run one masked SDPA; a lone prompt without a prefix runs plain causal.

    ``metadata`` (built here when None) holds the groups, gather ids and masks, so a
    step's layers share one build.
    """
    if metadata is None:
        metadata = metadata_for(inputs)
    out = torch.empty_like(inputs.query)
    attend_groups(inputs.query, inputs.k_cache, inputs.v_cache, metadata, inputs.scale, out)
    return out


def attend_groups(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: ExtendMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Write the attention of every group's rows into ``out`` (other rows untouched)."""
    group_size = query.shape[1] // k_cache.shape[2]
    for group in metadata.groups:
        out[group.row_start : group.row_end] = _attend_group(
            query[group.row_start : group.row_end], k_cache, v_cache, group, group_size, scale
        )


def _attend_group(
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: ExtendGroup,
    group_size: int,
    scale: float,
) -> torch.Tensor:
    """Attention output ``[rows, H_q, D]`` of one group's query rows."""
    num_q_heads, head_dim = rows.shape[1], rows.shape[2]
    num_kv_heads = num_q_heads // group_size
    k = gather_tokens(k_cache, group.ids)[:, : group.num_keys].transpose(1, 2)  # [b, H_kv, K, D]
    v = gather_tokens(v_cache, group.ids)[:, : group.num_keys].transpose(1, 2)
    if group.bias is None:
        q = rows.transpose(0, 1)[None]  # [1, H_q, q_len, D]
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=group_size > 1
        )
        return o[0].transpose(0, 1)
    b, q_pad = group.batch, group.q_pad
    if group.gather_rows is not None:
        rows = rows.index_select(0, group.gather_rows)
    # [b * Q, H_q, D] -> [b, H_kv, GROUP * Q, D]: one KV head's query heads share its keys.
    q = rows.view(b, q_pad, num_kv_heads, group_size, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(b, num_kv_heads, group_size * q_pad, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.bias, scale=scale)
    o = o.view(b, num_kv_heads, group_size, q_pad, head_dim).permute(0, 3, 1, 2, 4)
    o = o.reshape(b * q_pad, num_q_heads, head_dim)
    if group.valid_rows is not None:
        o = o.index_select(0, group.valid_rows)
    return o


def paged_extend_attention_triton(
    inputs: AttentionInputs, max_query_len: int | None = None
) -> torch.Tensor:
    """Launch ``paged_extend_kernel`` (inputs already checked).

    ``max_query_len`` sizes the grid; ``None`` reads it from ``query_start_loc``
    (a host sync on CUDA: pass it when the caller knows it).
    """
    query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale = inputs
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the triton backend needs a power-of-two head_dim >= 16, got {head_dim}")
    check_shared_strides(k_cache, v_cache)
    out = torch.empty_like(query)
    batch = context_lens.shape[0]
    if batch == 0 or query.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out
    on_cuda = query.device.type == "cuda"
    block_m = 64 if on_cuda else 16
    block_n = 64 if on_cuda else 16
    block_tables = block_tables.contiguous()
    grid = (batch, num_q_heads, triton.cdiv(max_query_len, block_m))
    runnable(paged_extend_kernel, query.device)[grid](
        query,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc.contiguous(),
        context_lens.contiguous(),
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        LOG2_BLOCK=block_size.bit_length() - 1,
        DOT_DTYPE=dot_dtype(query),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return out
