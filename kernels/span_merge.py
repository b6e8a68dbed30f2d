"""The merge of a row's span states, in span order (``kernels.span_attention_triton``).

A query row at position p has ``n = p // SPAN + 1`` spans; with n >= 2 the attention
kernel leaves, per span j, fp32 partial states (log2 domain, ``acc`` not divided by
``l``):

    part_ml  [T, max_spans, H_q, 2]   (m_j, l_j)
    part_acc [T, max_spans, H_q, D]   acc_j

and this kernel (grid ``(B, ceil(max_q_len / BLOCK_T), H_q)``) writes, for each such row,

    M = max_j m_j;  w_j = exp2(m_j - M);  out = (sum_j w_j acc_j) / (sum_j w_j l_j)

with j walked one span after another, so a row's sums are in its own order whatever
``max_spans`` (the batch's widest table) or its tile's other rows: a row past its own
spans skips the step (``where``), it adds no zeros. Rows with one span were written by
the attention kernel and are left alone. ``merge_spans_torch`` is the reference twin.
"""

from __future__ import annotations

import torch

from kernels.triton_compat import runnable, tl, triton

# Tokens per merge program (their rows of one query head).
MERGE_TOKENS = 16


@triton.jit
def span_merge_kernel(
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    query_start_ptr,
    context_lens_ptr,
    max_spans,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    prefix = tl.load(context_lens_ptr + b) - q_len
    tokens = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    num_spans = (prefix + tokens) // SPAN + 1
    merged = (tokens < q_len) & (num_spans > 1)
    num_spans = tl.where(merged, num_spans, 0)
    widest = tl.max(num_spans, 0)
    rows = ((q_start + tokens).to(tl.int64) * max_spans) * NUM_Q_HEADS + head
    dims = tl.arange(0, HEAD_DIM)
    top = tl.full([BLOCK_T], float("-inf"), tl.float32)
    for j in range(0, widest):
        use = j < num_spans
        m_j = tl.load(part_ml_ptr + (rows + j * NUM_Q_HEADS) * 2, mask=use, other=float("-inf"))
        top = tl.maximum(top, m_j)
    den = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, HEAD_DIM], tl.float32)
    for j in range(0, widest):
        use = j < num_spans
        part = rows + j * NUM_Q_HEADS
        m_j = tl.load(part_ml_ptr + part * 2, mask=use, other=0.0)
        l_j = tl.load(part_ml_ptr + part * 2 + 1, mask=use, other=0.0)
        a_j = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=use[:, None])
        w = tl.exp2(tl.where(use, m_j - top, 0.0))
        den = tl.where(use, den + w * l_j, den)
        acc = tl.where(use[:, None], acc + w[:, None] * a_j, acc)
    safe = tl.where(merged, den, 1.0)
    tl.store(
        out_ptr + (q_start + tokens)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        (acc / safe[:, None]).to(out_ptr.dtype.element_ty),
        mask=merged[:, None],
    )


def merge_spans(
    out: torch.Tensor,
    part_acc: torch.Tensor,
    part_ml: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    span: int,
) -> None:
    """Write the merged rows (those with several spans) into ``out [T, H_q, D]``."""
    batch = context_lens.shape[0]
    _, max_spans, num_q_heads, head_dim = part_acc.shape
    grid = (batch, triton.cdiv(max_query_len, MERGE_TOKENS), num_q_heads)
    runnable(span_merge_kernel, out.device)[grid](
        out,
        part_acc,
        part_ml,
        query_start_loc,
        context_lens,
        max_spans,
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        SPAN=span,
        BLOCK_T=MERGE_TOKENS,
    )


def merge_spans_torch(
    part_acc: torch.Tensor, part_ml: torch.Tensor, num_spans: torch.Tensor
) -> torch.Tensor:
    """Reference: rows ``[R]`` with ``num_spans[R]`` states each in ``part_acc [R, S, D]``
    and ``part_ml [R, S, 2]``; returns ``[R, D]`` fp32 by the formula above."""
    spans = torch.arange(part_acc.shape[1], device=part_acc.device)
    use = spans[None, :] < num_spans[:, None]
    m = part_ml[..., 0].masked_fill(~use, float("-inf"))
    w = torch.exp2(m - m.amax(dim=1, keepdim=True)).masked_fill(~use, 0.0)
    acc = (w[:, :, None] * part_acc.masked_fill(~use[:, :, None], 0.0)).sum(dim=1)
    return acc / (w * part_ml[..., 1].masked_fill(~use, 0.0)).sum(dim=1, keepdim=True)
