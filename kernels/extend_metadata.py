"""How the torch extend path batches a step's sequences into padded attention groups.

A step that is not pure decode mixes sequences with one new token (decodes) and
sequences with many (new turns, prefill chunks). Attending one sequence at a
time costs one SDPA call per sequence per layer, so the torch path packs
neighbouring sequences of the same kind into groups, built once per step:

    rows      | d d d d | e e e e e e e . | e e e e e e . . | E E E E E E E E E E E E |
    groups    | decodes | extends, padded to the longest run  | one long prefill       |
                Q = 1     Q = 7 (pad rows marked .)             causal, no mask

Within a group of ``b`` sequences, ``Q`` (the longest new-token run) and ``K``
(the longest context, whole blocks) are padded, and the GROUP query heads of a
KV head are folded into SDPA's query axis, so one call covers the group:

    q    [b, H_kv, GROUP * Q, D]   row g * Q + i = head g of new token i
    k, v [b, H_kv, K, D]           gathered whole blocks
    bias [b, 1, GROUP * Q, K]      0 where key j <= the token's position, -inf elsewhere
                                   ([b, 1, 1, K] for decodes: one position per sequence)

A pad row repeats its sequence's last token, so it sees a non-empty key range
(no NaN) and is dropped afterwards. Groups stay under a padding ratio, so a
decode row is never padded to a prefill's length, and under the decode path's
gather byte budget.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import step_metadata
from kernels.paged_gather import batch_block_ids, masked_scores_bias

# Padded attention work (b * Q * K) may exceed the real work (sum of q_len * context)
# by this factor plus PADDING_SLACK query-key pairs: eight new turns of 20-40 tokens
# share a call, a decode never joins a prefill.
MAX_PADDING_RATIO = 1.25
PADDING_SLACK = 16384


class ExtendGroup(NamedTuple):
    """Sequences attended in one SDPA call; rows ``[row_start, row_end)`` of the query."""

    row_start: int
    row_end: int
    batch: int  # b
    q_pad: int  # Q
    num_keys: int  # K
    ids: torch.Tensor  # [b, n] block ids (padding -> block 0)
    bias: torch.Tensor | None  # see the module docstring; None: one causal prefill
    gather_rows: torch.Tensor | None  # [b * Q] group row of each padded row; None: no pad
    valid_rows: torch.Tensor | None  # [row_end - row_start] padded row of each real row


class ExtendMetadata(NamedTuple):
    """The torch extend path's per-step groups (see the module docstring)."""

    block_size: int
    group_size: int  # query heads per KV head the biases were folded for
    num_tokens: int
    batch: int
    groups: tuple[ExtendGroup, ...]


class _Seq(NamedTuple):
    start: int  # first query row
    q_len: int
    context_len: int


def extend_metadata(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    group_size: int,
    kv_row_bytes: int,
    dtype: torch.dtype,
) -> ExtendMetadata:
    """Groups, gather ids, masks and row maps of one extend step.

    group_size: query heads per KV head; kv_row_bytes: bytes of one token's K in one
    layer (sizes the groups); dtype: the attention's dtype (the masks').
    """
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    seqs = [
        (b, _Seq(starts[b], starts[b + 1] - starts[b], lens[b]))
        for b in range(len(lens))
        if starts[b + 1] > starts[b]
    ]
    groups = []
    i = 0
    while i < len(seqs):
        j = i + 1
        while j < len(seqs) and _fits([s for _, s in seqs[i : j + 1]], block_size, kv_row_bytes):
            j += 1
        members = seqs[i:j]
        index = torch.tensor([b for b, _ in members], device=block_tables.device)
        groups.append(
            _build_group(
                [s for _, s in members],
                block_tables.index_select(0, index),
                block_size,
                group_size,
                dtype,
            )
        )
        i = j
    return ExtendMetadata(block_size, group_size, starts[-1], len(lens), tuple(groups))


def _fits(members: list[_Seq], block_size: int, kv_row_bytes: int) -> bool:
    """Whether ``members`` may share one padded call."""
    decode = members[0].q_len == 1
    if any((m.q_len == 1) != decode for m in members):
        return False
    num_keys = _padded_keys(max(m.context_len for m in members), block_size)
    if len(members) * num_keys * kv_row_bytes > step_metadata.GATHER_CHUNK_BYTES:
        return False
    if decode:
        return True
    padded = len(members) * max(m.q_len for m in members) * num_keys
    real = sum(m.q_len * m.context_len for m in members)
    return padded <= MAX_PADDING_RATIO * real + PADDING_SLACK


def _padded_keys(context_len: int, block_size: int) -> int:
    return -(-context_len // block_size) * block_size


def _build_group(
    members: list[_Seq],
    tables: torch.Tensor,
    block_size: int,
    group_size: int,
    dtype: torch.dtype,
) -> ExtendGroup:
    device = tables.device
    row_start = members[0].start
    row_end = members[-1].start + members[-1].q_len
    b = len(members)
    context_lens = torch.tensor([m.context_len for m in members], device=device)
    ids, num_keys = batch_block_ids(tables, context_lens, block_size)
    q_pad = max(m.q_len for m in members)
    only = members[0]
    if b == 1 and only.q_len == only.context_len:
        # A prompt with no cached prefix: plain causal attention over exactly its tokens,
        # which the fused kernel runs without a mask, skipping the masked half.
        return ExtendGroup(row_start, row_end, 1, q_pad, only.context_len, ids, None, None, None)
    # Position of every padded query row; a pad row repeats its sequence's last token.
    positions, gather_rows, valid_rows = [], [], []
    for index, m in enumerate(members):
        first = m.context_len - m.q_len
        for i in range(q_pad):
            real = min(i, m.q_len - 1)
            positions.append(first + real)
            gather_rows.append(m.start - row_start + real)
            if i < m.q_len:
                valid_rows.append(index * q_pad + i)
    query_pos = torch.tensor(positions, device=device).view(b, q_pad)
    key_pos = torch.arange(num_keys, device=device)
    allowed = key_pos[None, None, :] <= query_pos[:, :, None]  # [b, Q, K]
    bias = masked_scores_bias(allowed, dtype)
    if q_pad == 1:
        bias = bias[:, None]  # [b, 1, 1, K]: broadcast over the folded heads
    else:
        bias = bias[:, None].expand(b, group_size, q_pad, num_keys)
        bias = bias.reshape(b, 1, group_size * q_pad, num_keys)
    padded = len(valid_rows) != b * q_pad
    return ExtendGroup(
        row_start,
        row_end,
        b,
        q_pad,
        num_keys,
        ids,
        bias,
        torch.tensor(gather_rows, device=device) if padded else None,
        torch.tensor(valid_rows, device=device) if padded else None,
    )


def check_extend_metadata(
    metadata: ExtendMetadata, num_tokens: int, batch: int, block_size: int, group_size: int
) -> None:
    """Raise ``ValueError`` unless ``metadata`` was built for this step's shapes."""
    if not isinstance(metadata, ExtendMetadata):
        raise ValueError(f"metadata must be an ExtendMetadata, got {type(metadata).__name__}")
    built = (metadata.num_tokens, metadata.batch, metadata.block_size, metadata.group_size)
    if built != (num_tokens, batch, block_size, group_size):
        raise ValueError(
            "metadata built for tokens / batch / block_size / group "
            f"{built}, got {(num_tokens, batch, block_size, group_size)}"
        )
