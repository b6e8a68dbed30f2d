"""How the torch attention path batches a step's sequences into padded SDPA groups.

A step mixes sequences with one new token (decodes) and sequences with many (new
turns, prefill chunks); a decode step is the case where all have one. Attending
one sequence at a time costs one SDPA call per sequence per layer, so the torch
path (decode and extend alike) packs neighbouring sequences of the same kind
into groups, built once per step:

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
decode row is never padded to a prefill's length, and under a gather byte
budget (``GATHER_CHUNK_BYTES``).

With the native CPU kernel (``kernels.cpu.attention``), sequences with at most
``native_max_query`` new tokens are left out of the groups and listed in
``native_seqs``: the kernel reads their blocks in place, and only longer runs
(prefill chunks, where SDPA's matrix products win) are grouped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.attention_inputs import AttentionInputs
from kernels.paged_gather import batch_block_ids, masked_scores_bias

# Gathered K of one attention group stays under this. Larger groups mean fewer, wider SDPA
# calls, which were faster than 4 MiB groups (docs/kernels.md, "Torch references"); the
# cap keeps one group's K and V buffers to a few tens of MB.
GATHER_CHUNK_BYTES = 16 << 20


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
    native_max_query: int  # new tokens up to which a sequence is left to the native kernel
    native_seqs: torch.Tensor  # [n] int32 batch indices of those sequences


class _Seq(NamedTuple):
    index: int  # in the batch
    start: int  # first query row
    q_len: int
    context_len: int


class _Filling:
    """The group being filled: its members and the sizes the padding rule needs."""

    def __init__(self, seq: _Seq) -> None:
        self.members = [seq]
        self.decode = seq.q_len == 1
        self.longest = seq.context_len
        self.widest = seq.q_len
        self.real = seq.q_len * seq.context_len

    def admits(self, seq: _Seq, block_size: int, kv_row_bytes: int) -> bool:
        """Whether ``seq`` may join: same kind, gather under budget, padding bounded."""
        if (seq.q_len == 1) != self.decode:
            return False
        count = len(self.members) + 1
        num_keys = _padded_keys(max(self.longest, seq.context_len), block_size)
        if count * num_keys * kv_row_bytes > GATHER_CHUNK_BYTES:
            return False
        if self.decode:
            return True
        padded = count * max(self.widest, seq.q_len) * num_keys
        real = self.real + seq.q_len * seq.context_len
        return padded <= MAX_PADDING_RATIO * real + PADDING_SLACK

    def add(self, seq: _Seq) -> None:
        self.members.append(seq)
        self.longest = max(self.longest, seq.context_len)
        self.widest = max(self.widest, seq.q_len)
        self.real += seq.q_len * seq.context_len


def extend_metadata(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    group_size: int,
    kv_row_bytes: int,
    dtype: torch.dtype,
    native_max_query: int = 0,
) -> ExtendMetadata:
    """Groups, gather ids, masks and row maps of one step (a decode step is the case
    where every ``q_len`` is 1: one group per gather budget, no padding).

    group_size: query heads per KV head; kv_row_bytes: bytes of one token's K in one
    layer (sizes the groups); dtype: the attention's dtype (the masks');
    native_max_query: see the module docstring (0: every sequence is grouped).
    """
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    filled: list[_Filling] = []
    native: list[int] = []
    open_group = False  # a group's rows are contiguous: a native sequence closes it
    for b, context_len in enumerate(lens):
        seq = _Seq(b, starts[b], starts[b + 1] - starts[b], context_len)
        if seq.q_len == 0:
            continue
        if seq.q_len <= native_max_query:
            native.append(b)
            open_group = False
        elif open_group and filled[-1].admits(seq, block_size, kv_row_bytes):
            filled[-1].add(seq)
        else:
            filled.append(_Filling(seq))
            open_group = True
    groups = tuple(
        _build_group(f.members, block_tables, block_size, group_size, dtype) for f in filled
    )
    native_seqs = torch.tensor(native, dtype=torch.int32, device=block_tables.device)
    return ExtendMetadata(
        block_size, group_size, starts[-1], len(lens), groups, native_max_query, native_seqs
    )


def metadata_for(inputs: AttentionInputs, native_max_query: int = 0) -> ExtendMetadata:
    """``extend_metadata`` of one layer's attention inputs (sizes read off its query and
    K cache; ``inputs.query_start_loc`` set)."""
    query, k_cache = inputs.query, inputs.k_cache
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    return extend_metadata(
        inputs.block_tables,
        inputs.query_start_loc,
        inputs.context_lens,
        k_cache.shape[1],
        query.shape[1] // num_kv_heads,
        num_kv_heads * head_dim * k_cache.element_size(),
        query.dtype,
        native_max_query,
    )


def _padded_keys(context_len: int, block_size: int) -> int:
    return -(-context_len // block_size) * block_size


def _build_group(
    members: list[_Seq],
    block_tables: torch.Tensor,
    block_size: int,
    group_size: int,
    dtype: torch.dtype,
) -> ExtendGroup:
    device = block_tables.device
    batch_rows = torch.tensor([m.index for m in members], device=device)
    tables = block_tables.index_select(0, batch_rows)
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
    for k, m in enumerate(members):
        first = m.context_len - m.q_len
        for i in range(q_pad):
            real = min(i, m.q_len - 1)
            positions.append(first + real)
            gather_rows.append(m.start - row_start + real)
            if i < m.q_len:
                valid_rows.append(k * q_pad + i)
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
    metadata: ExtendMetadata,
    num_tokens: int,
    batch: int,
    block_size: int,
    group_size: int,
    native: bool = False,
) -> None:
    """Raise ``ValueError`` unless ``metadata`` was built for this step's shapes, and
    (unless ``native``: the caller runs the native kernel) groups every sequence."""
    if not isinstance(metadata, ExtendMetadata):
        raise ValueError(f"metadata must be an ExtendMetadata, got {type(metadata).__name__}")
    built = (metadata.num_tokens, metadata.batch, metadata.block_size, metadata.group_size)
    if built != (num_tokens, batch, block_size, group_size):
        raise ValueError(
            "metadata built for tokens / batch / block_size / group "
            f"{built}, got {(num_tokens, batch, block_size, group_size)}"
        )
    if metadata.native_max_query and not native:
        raise ValueError(
            "metadata leaves sequences to the native kernel (native_max_query "
            f"{metadata.native_max_query}): build it with native_max_query=0 for this backend"
        )
