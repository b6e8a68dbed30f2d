"""Invariant paged attention in torch: every reduction at one fixed shape (the torch path
when ``invariant``, ``kernels.invariance``).

The grouped SDPA path (``kernels.extend_attention.attend_groups``) packs a step's
sequences into padded calls shaped by the step, and torch's matrix products pick their
summation order by shape: a token's bits moved with its companions, its chunk and its
cache state. Here a token's work is tasks of one shape (``kernels.span_metadata``): per
span of ``SPAN_TOKENS`` absolute positions and KV head, its query heads against the
span's keys,

    scores = q . K_span^T * scale, keys past the token masked
    out_j  = softmax(scores) . V_span      lse_j = log-sum-exp(scores)

run by torch's CPU flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``),
which computes each task on one thread with products of that one shape (its key blocks
are 512 wide, so a span is one block: one softmax, no rescaling inside it). A token
with several spans merges them in span order:

    M = max_j lse_j;  w_j = exp(lse_j - M);  out = (sum_j w_j out_j) / (sum_j w_j)

each sum a running sum along the spans, span 0 first, read at the token's own last span.
All arithmetic is fp32 (bf16 inputs widened, int8 rows times their scales as gathered,
the output rounded once; bf16's own flash
path was faster for decodes and slower for prefill chunks, docs/kernels.md). The bits of
a token's output then do not depend on which tasks share a call, on the thread count,
or on where a task sits in its call: measured (tests/kernels/test_span_attention.py),
not promised by torch, which is why the shapes stay fixed rather than merely similar.
Cost: docs/kernels.md, "Invariance".
"""

from __future__ import annotations

import torch

from kernels.attention_inputs import AttentionInputs
from kernels.kv_layout import KVScales
from kernels.paged_gather import gather_tokens
from kernels.span_metadata import SpanMetadata, span_metadata, task_rows

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def span_metadata_for(inputs: AttentionInputs) -> SpanMetadata:
    """``span_metadata`` of one layer's inputs (``inputs.query_start_loc`` set)."""
    query, k_cache = inputs.query, inputs.k_cache
    return span_metadata(
        inputs.block_tables,
        inputs.query_start_loc,
        inputs.context_lens,
        k_cache.shape[1],
        query.shape[1] // k_cache.shape[2],
    )


def paged_attention_spans(
    inputs: AttentionInputs, metadata: SpanMetadata | None = None, scales: KVScales | None = None
) -> torch.Tensor:
    """Invariant attention of checked inputs that have their start tensor; ``metadata``
    (built here when None) lets a step's layers share one plan; ``scales``: an int8
    cache's (``kernels.kv_layout``)."""
    if metadata is None:
        metadata = span_metadata_for(inputs)
    query, k_cache, v_cache = inputs.query, inputs.k_cache, inputs.v_cache
    return attend_spans(query, k_cache, v_cache, metadata, inputs.scale, scales)


def attend_spans(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: SpanMetadata,
    scale: float,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """``[T, H_q, D]`` attention of ``query`` over one layer's caches, by ``metadata``'s plan.
    An int8 cache's rows are dequantized as they are gathered (``scales``: theirs)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(query)
    if not metadata.calls:
        return out
    group = num_q_heads // num_kv_heads
    # A fresh fp32 copy of the rows (every task's rows aligned alike) and a zero token
    # (row T) for the empty slots.
    q = torch.zeros(
        num_tokens + 1, num_kv_heads, group, head_dim, dtype=torch.float32, device=query.device
    )
    q[:num_tokens] = query.view(num_tokens, num_kv_heads, group, head_dim)
    k_scale, v_scale = (None, None) if scales is None else scales
    keys = _span_keys(k_cache, metadata, k_scale)  # [groups, H_kv, S, D]
    values = _span_keys(v_cache, metadata, v_scale)
    rows = task_rows(group, metadata.slots_per_task)
    slot_rows = metadata.slots_per_task * group
    states, lses = [], []
    for call in metadata.calls:
        tasks = call.slots.shape[0]
        # [tasks, slots, H_kv, G, D] -> [tasks, H_kv, rows, D], zero rows past the slots'.
        picked = q.index_select(0, call.slots.view(-1)).view(
            tasks, -1, num_kv_heads, group, head_dim
        )
        task_q = q.new_zeros(tasks, num_kv_heads, rows, head_dim)
        task_q[:, :, :slot_rows] = picked.transpose(1, 2).reshape(
            tasks, num_kv_heads, slot_rows, head_dim
        )
        stop = call.first_group + call.num_groups
        k, v = keys[call.first_group : stop], values[call.first_group : stop]
        if call.num_groups != tasks:  # a run: its tasks share the group's keys
            k, v = k.expand(tasks, -1, -1, -1), v.expand(tasks, -1, -1, -1)
        o, lse = attend_tasks(task_q, k, v, call.bias, scale)
        # Back to one state per slot: [tasks * slots, H_q, D] and [tasks * slots, H_q].
        o = o[:, :, :slot_rows].reshape(tasks, num_kv_heads, -1, group, head_dim)
        states.append(o.transpose(1, 2).reshape(-1, num_q_heads, head_dim))
        lse = lse[:, :, :slot_rows].reshape(tasks, num_kv_heads, -1, group)
        lses.append(lse.transpose(1, 2).reshape(-1, num_q_heads))
    state = torch.cat(states) if len(states) > 1 else states[0]
    lse = torch.cat(lses) if len(lses) > 1 else lses[0]
    if metadata.direct_rows.numel():
        direct = state.index_select(0, metadata.direct_states)
        out.index_copy_(0, metadata.direct_rows, direct.to(query.dtype))
    if metadata.merge_rows.numel():
        merged = _merge(state, lse, metadata.merge_states, metadata.merge_valid)
        out.index_copy_(0, metadata.merge_rows, merged.to(query.dtype))
    return out


def attend_tasks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tasks ``q [n, H_kv, rows, D]`` over ``k``/``v`` ``[n, H_kv, S, D]`` with the additive
    ``bias [n, 1, rows, S]``: ``(out [n, H_kv, rows, D], lse [n, H_kv, rows])``, fp32.

    On the CPU torch's flash kernel runs them (see the module docstring). Elsewhere (the
    torch reference on CUDA, an oracle for the Triton kernels, never a serving path) the
    same softmax in plain torch ops: right, but its matrix products are the device
    library's, whose order for a task may follow the batch (not measured)."""
    if q.device.type == "cpu":
        return _flash(q, k, v, attn_mask=bias, scale=scale)
    return tasks_in_plain_ops(q, k, v, bias, scale)


def tasks_in_plain_ops(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend_tasks`` off the CPU: matmul, softmax and log-sum-exp in torch ops."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale + bias
    top = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    out = torch.matmul(weights, v) / total
    return out, (top + torch.log(total)).squeeze(-1)


def _span_keys(
    cache: torch.Tensor, metadata: SpanMetadata, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Every group's S keys of one layer, fp32 ``[groups, H_kv, S, D]`` (a strided view of a
    fresh copy), zero past the context: masked keys enter no sum, and garbage there may be
    NaN. An int8 cache's rows times their ``scale`` (exact in fp32: q * s needs 15 bits)."""
    gathered = gather_tokens(cache, metadata.block_ids).float()  # [groups, S, H_kv, D]
    if scale is not None:
        gathered *= gather_tokens(scale.unsqueeze(-1), metadata.block_ids).float()
    if metadata.keys_outside.numel():
        flat = gathered.view(-1, gathered.shape[2] * gathered.shape[3])
        flat.index_fill_(0, metadata.keys_outside, 0.0)
    return gathered.transpose(1, 2)


def _merge(
    states: torch.Tensor, lse: torch.Tensor, index: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Each row's span states merged in span order (see the module docstring).

    The sums are running sums along the spans (``cumsum``: one add after another, span
    0 first), read at each row's own last span: a row's sums never see the pads after it.
    """
    rows, num_spans = index.shape
    flat = index.view(-1)
    outs = states.index_select(0, flat).view(rows, num_spans, *states.shape[1:])
    logs = lse.index_select(0, flat).view(rows, num_spans, -1)
    logs = logs.masked_fill(~valid[:, :, None], float("-inf"))
    weights = torch.exp(logs - logs.amax(dim=1, keepdim=True))  # [m, n, H_q]; pads: 0
    last = (valid.sum(dim=1) - 1).view(rows, 1, 1)
    den = weights.cumsum(dim=1).gather(1, last.expand(-1, -1, weights.shape[2]))
    num = (outs * weights[..., None]).cumsum(dim=1)
    num = num.gather(1, last[..., None].expand(-1, -1, *num.shape[2:]))
    return (num / den[..., None]).squeeze(1)
