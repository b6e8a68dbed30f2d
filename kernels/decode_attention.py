"""Paged decode attention: one query token per sequence over its whole context.

Triton algorithm (flash-decoding):

    grid = (B, H_kv, num_partitions)
    program (b, kv_head, p) takes the GROUP query heads that share kv_head
    (loaded as one [GROUP_P2, D] tile so K/V are read once for the group) and
    the context slice [p * partition, (p + 1) * partition):

        seq b context:  | part 0 | part 1 | part 2 |  ...
                          ^ one program each, tiles of BLOCK_N tokens

    It runs an online softmax in fp32 over BLOCK_N-token tiles (each token's
    block id comes from the table; offsets by shift and mask) and writes its
    partial (max, sum, normalised acc). ``paged_decode_reduce_kernel`` then
    (``decode_split.py``) merges the partials of each (b, head): out = sum_p w_p acc_p / sum_p w_p
    with w_p = sum_p * 2^(max_p - max). With a single partition the first
    kernel writes the output directly and the reduce is skipped.
"""

from __future__ import annotations

import math

import torch

from kernels.attention_inputs import AttentionInputs
from kernels.decode_split import choose_partition, merge_partitions
from kernels.extend_attention import paged_extend_attention_torch
from kernels.extend_metadata import ExtendMetadata
from kernels.triton_compat import dot_dtype, runnable, tl, triton
from kernels.validate import (
    check_block_tables,
    check_index,
    check_kv_caches,
    check_query,
    check_scale,
    check_shared_strides,
)

# Scores of masked positions are -inf; the running max starts finite so that
# exp2(score - max) never evaluates inf - inf (it is 0 for masked scores).
_NEG_INIT = tl.constexpr(-1.0e30)


@triton.jit
def paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    partition,
    num_parts,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    LOG2_BLOCK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + b)
    start = part * partition
    end = tl.minimum(start + partition, context_len)

    rows = tl.arange(0, GROUP_P2)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    ).to(DOT_DTYPE)

    m_i = tl.full([GROUP_P2], _NEG_INIT, tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + b * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        block = tl.load(table_row + (pos >> LOG2_BLOCK), mask=pos_mask, other=0).to(tl.int64)
        offset = (pos & ((1 << LOG2_BLOCK) - 1)).to(tl.int64)
        row_base = block * stride_cb + offset * stride_cs + kv_head * stride_ch
        kv_offsets = row_base[:, None] + dims[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=pos_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=pos_mask[:, None], other=0.0)

        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee") * scale_log2
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # An empty partition (start >= context_len) has l_i == 0: store zeros.
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / safe_l[:, None]
    if SPLIT:
        part_index = (b * NUM_Q_HEADS + heads) * num_parts + part
        tl.store(part_max_ptr + part_index, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part_index, l_i, mask=row_mask)
        tl.store(
            part_out_ptr + part_index[:, None] * HEAD_DIM + dims[None, :],
            result,
            mask=row_mask[:, None],
        )
    else:
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None],
        )


def check_decode(inputs: AttentionInputs, check_bounds: bool = True) -> None:
    """Raise ``ValueError`` unless a decode's inputs are consistent (one new token per
    sequence: ``query [B, H_q, D]``; ``inputs.query_start_loc`` is not read)."""
    query, k_cache, v_cache, block_tables, _, context_lens, scale = inputs
    num_blocks, block_size, _, _ = check_kv_caches(k_cache, v_cache)
    check_query(query, k_cache)
    if query.stride(-1) != 1:
        raise ValueError("the head_dim axis of query must be contiguous")
    check_index("block_tables", block_tables, 2, k_cache.device)
    check_index("context_lens", context_lens, 1, k_cache.device)
    batch = query.shape[0]
    if block_tables.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(
            f"batch mismatch: query {batch}, block_tables {block_tables.shape[0]}, "
            f"context_lens {context_lens.shape[0]}"
        )
    check_scale(scale)
    if check_bounds and batch:
        check_block_tables(block_tables, context_lens, num_blocks, block_size)


def paged_decode_attention_torch(
    inputs: AttentionInputs, metadata: ExtendMetadata | None = None
) -> torch.Tensor:
    """Reference: the extend reference with one new token per sequence.

    Its groups (``kernels.extend_metadata``) then hold sequences of one decode batch
    under a gather budget, and GQA needs no K/V copy per query head: the GROUP query
    heads of a KV head become SDPA's query-length axis, ``q [b, H_kv, GROUP, D]``
    against ``k [b, H_kv, T, D]``, so every query row sees the same key mask.
    ``metadata`` (built here when None) lets a step's layers share one build.
    """
    return paged_extend_attention_torch(inputs.one_token_each(), metadata)


def paged_decode_attention_triton(
    inputs: AttentionInputs, partition_size: int | None = None
) -> torch.Tensor:
    """Launch the decode kernels (inputs already checked; no start tensor read).

    ``partition_size`` (tokens, a multiple of the tile size: 64 on CUDA, 16 when
    interpreted) forces the flash-decoding split; ``None`` picks one from the
    device's SM count. The number of partitions comes from the table width, so
    no host sync on ``context_lens`` is needed.
    """
    query, k_cache, v_cache, block_tables, _, context_lens, scale = inputs
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the triton backend needs a power-of-two head_dim >= 16, got {head_dim}")
    check_shared_strides(k_cache, v_cache)
    out = torch.empty_like(query)
    if batch == 0:
        return out
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    group = num_q_heads // num_kv_heads
    block_n = 64 if query.device.type == "cuda" else 16
    max_len = block_tables.shape[1] * block_size
    if partition_size is None:
        num_sms = None
        if query.device.type == "cuda":
            num_sms = torch.cuda.get_device_properties(query.device).multi_processor_count
        partition_size = choose_partition(num_sms, batch, num_kv_heads, max_len, block_n)
    elif partition_size <= 0 or partition_size % block_n:
        raise ValueError(f"partition_size must be a positive multiple of {block_n}")
    num_parts = max(1, -(-max_len // partition_size))
    split = num_parts > 1
    f32 = torch.float32
    if split:
        part_out = torch.empty(
            batch, num_q_heads, num_parts, head_dim, dtype=f32, device=out.device
        )
        part_max = torch.empty(batch, num_q_heads, num_parts, dtype=f32, device=out.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out
    runnable(paged_decode_kernel, query.device)[(batch, num_kv_heads, num_parts)](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_max,
        part_sum,
        scale * math.log2(math.e),
        partition_size if split else max_len,
        num_parts,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        GROUP_P2=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        LOG2_BLOCK=block_size.bit_length() - 1,
        DOT_DTYPE=dot_dtype(query),
        BLOCK_N=block_n,
        SPLIT=split,
    )
    if split:
        merge_partitions(out, part_out, part_max, part_sum)
    return out
