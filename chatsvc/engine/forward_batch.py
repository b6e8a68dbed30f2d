"""Per-step batch metadata: everything one forward pass needs, in one explicit object.

B sequences contribute q_len[b] >= 1 new tokens each; the tokens lie flat in T rows:

    rows      | seq 0: q_len[0] rows | seq 1: q_len[1] rows | ... |
    query_start_loc = [0, q_len[0], q_len[0] + q_len[1], ..., T]
    logits_indices[b] = query_start_loc[b + 1] - 1   (each sequence's last new token)

A sequence may ask for the logits of more of its new tokens (``num_logits[b]``, its
trailing rows: prompt logprobs); ``logits_indices`` then lists those rows, sequence
by sequence, each sequence's last new token last, and the model returns one logits
row per entry, in that order.

Sequence b already has ``context_lens[b] - q_len[b]`` tokens in the KV cache, so its
new token i sits at position ``context_lens[b] - q_len[b] + i`` and writes its K/V to
``slot_mapping[row]`` (``block * block_size + offset``; -1 = skip).

The index tensors, ``is_decode`` and ``max_query_len`` are what a step's kernels read
(``kernels.step.StepBatch``): ``bind_step`` builds each backend's per-step metadata
from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32, including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past a sequence's blocks
    logits_indices: torch.Tensor  # [R] int64, R = sum of num_logits (B when each wants 1)
    is_decode: bool  # every sequence has exactly one new token
    max_query_len: int
    max_context_len: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @classmethod
    def from_lists(
        cls,
        token_ids: Sequence[Sequence[int]],
        num_computed: Sequence[int],
        slot_mappings: Sequence[Sequence[int]],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        num_logits: Sequence[int] | None = None,
    ) -> ForwardBatch:
        """Build a step from plain lists, one entry per sequence.

        token_ids[b]: the new tokens of sequence b; num_computed[b]: tokens of b whose KV
        is already cached; slot_mappings[b]: one slot per new token; block_tables[b]: the
        physical block of each logical block of b; num_logits[b]: how many of b's last new
        tokens need logits (default 1). Raises ValueError on inconsistent input.
        """
        num_seqs = len(token_ids)
        if num_seqs == 0:
            raise ValueError("a forward batch needs at least one sequence")
        if not (len(num_computed) == len(slot_mappings) == len(block_tables) == num_seqs):
            raise ValueError(
                "token_ids, num_computed, slot_mappings and block_tables must have one entry "
                f"per sequence; got {len(token_ids)}, {len(num_computed)}, "
                f"{len(slot_mappings)}, {len(block_tables)}"
            )
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_logits is not None and len(num_logits) != num_seqs:
            raise ValueError(f"num_logits has {len(num_logits)} entries for {num_seqs} sequences")
        flat_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        context_lens: list[int] = []
        for b in range(num_seqs):
            new, done, seq_slots, table = (
                token_ids[b],
                num_computed[b],
                slot_mappings[b],
                block_tables[b],
            )
            if not new:
                raise ValueError(f"sequence {b} has no new tokens")
            if done < 0:
                raise ValueError(f"sequence {b}: num_computed must be >= 0, got {done}")
            if len(seq_slots) != len(new):
                raise ValueError(f"sequence {b}: {len(new)} new tokens but {len(seq_slots)} slots")
            total = done + len(new)
            if len(table) * block_size < total:
                raise ValueError(
                    f"sequence {b}: {len(table)} blocks of {block_size} cannot hold {total} tokens"
                )
            flat_ids.extend(new)
            positions.extend(range(done, total))
            slots.extend(seq_slots)
            starts.append(starts[-1] + len(new))
            context_lens.append(total)
        max_blocks = max(len(t) for t in block_tables)
        padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
        q_lens = [starts[b + 1] - starts[b] for b in range(num_seqs)]
        logits_rows: list[int] = []
        for b in range(num_seqs):
            wanted = 1 if num_logits is None else num_logits[b]
            if not 1 <= wanted <= q_lens[b]:
                raise ValueError(
                    f"sequence {b}: num_logits must be in [1, {q_lens[b]}], got {wanted}"
                )
            logits_rows.extend(range(starts[b + 1] - wanted, starts[b + 1]))

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            input_ids=tensor(flat_ids, torch.int64),
            positions=tensor(positions, torch.int64),
            slot_mapping=tensor(slots, torch.int64),
            query_start_loc=tensor(starts, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            block_tables=tensor(padded, torch.int32),
            logits_indices=tensor(logits_rows, torch.int64),
            is_decode=all(q == 1 for q in q_lens),
            max_query_len=max(q_lens),
            max_context_len=max(context_lens),
        )
