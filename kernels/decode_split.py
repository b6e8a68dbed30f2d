"""Flash-decoding split: how long a decode partition is, and merging the partials.

With ``P`` partitions, decode program (b, kv_head, p) leaves for each of its
query heads the partial ``max_p`` (log2 domain), ``sum_p`` and ``acc_p`` (already
divided by ``sum_p``) of its context slice, in fp32:

    part_max, part_sum: [B, H_q, P]      part_out: [B, H_q, P, D]

``paged_decode_reduce_kernel`` (grid ``(B, H_q)``) rescales them to the global
max and merges: ``out = sum_p w_p acc_p / sum_p w_p`` with
``w_p = sum_p * 2^(max_p - max)``. Empty partitions (past the context) carry
``sum_p = 0`` and drop out.
"""

from __future__ import annotations

import torch

from kernels.triton_compat import runnable, tl, triton


@triton.jit
def paged_decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_parts,
    stride_ob,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PARTS_P2: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    parts = tl.arange(0, PARTS_P2)
    part_mask = parts < num_parts
    base = (b * NUM_Q_HEADS + head) * num_parts
    m = tl.load(part_max_ptr + base + parts, mask=part_mask, other=float("-inf"))
    s = tl.load(part_sum_ptr + base + parts, mask=part_mask, other=0.0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(
        part_out_ptr + (base + parts)[:, None] * HEAD_DIM + dims[None, :],
        mask=part_mask[:, None],
        other=0.0,
    )
    weight = tl.exp2(m - tl.max(m, 0)) * s
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
    )


def choose_partition(
    num_sms: int | None, batch: int, num_kv_heads: int, max_len: int, block_n: int
) -> int:
    """Tokens per decode program: the whole table unless SMs would sit idle.

    Split only when (batch x kv heads) programs would leave SMs idle; aim for
    ~2 programs per SM and never partitions shorter than 256 tokens (nor the tile).
    ``num_sms`` is None off CUDA (the interpreter): no split unless forced.
    """
    if num_sms is None:
        return max_len
    factor = min(-(-2 * num_sms // (batch * num_kv_heads)), -(-max_len // 256))
    if factor <= 1:
        return max_len
    partition = triton.next_power_of_2(-(-max_len // factor))
    return max(partition, 256, block_n)


def merge_partitions(
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
) -> None:
    """Write the merged ``[B, H_q, D]`` result of the partials into ``out``."""
    batch, num_q_heads, num_parts, head_dim = part_out.shape
    runnable(paged_decode_reduce_kernel, out.device)[(batch, num_q_heads)](
        out,
        part_out,
        part_max,
        part_sum,
        num_parts,
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        PARTS_P2=triton.next_power_of_2(num_parts),
    )
