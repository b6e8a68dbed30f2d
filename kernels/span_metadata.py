"""How the invariant torch attention cuts a step into fixed-shape tasks, built once per step.

A query token at position p attends to keys 0..p, cut at absolute multiples of
``S = kernels.invariance.SPAN_TOKENS`` (its spans; ``kernels.span_attention`` attends
to each span and merges them):

    positions   0 ........ S-1 | S ....... 2S-1 | 2S ... p
    spans       span 0         | span 1         | span 2, keys past p masked

A *group* is one sequence's span: its S keys, gathered once per layer as whole blocks
(keys past the context zeroed there: never garbage, which may be NaN). A *task* is a
fixed number of token slots (``task_tokens(G)``) of one group with one KV head: the
slots' query heads of that KV head against the group's S keys, ``[rows, D] x [D, S]``
with ``rows = task_rows(G)``, the same for every task of every step. A decode fills one
slot (the others are zero rows); a run of new tokens fills them in order:

    groups  | 0 .. n1-1            | n1                 | n1+1 ...
            | one new token each   | a run of c tokens  | another run
    calls   | one call, n1 tasks   | ceil(c / TASK_TOKENS) tasks, the group's K/V
                                   broadcast over them (one call per run)

Each filled slot leaves one *state* per (token, span): the span's normalised output and
log-sum-exp for the token's query heads. A token with one span takes its state as it is;
a token with several merges them in span order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import invariance

# Query rows a task aims at: a decode fills one token slot and leaves the rest zero, a
# prefill fills them all, so this trades the decodes' wasted rows against the prefill's
# per-task overhead (measured in docs/kernels.md, "Invariance").
TASK_ROWS = 8
# Rows per task at least: torch's CPU products with 1 or 3 query rows take other paths
# on its worker threads than on the calling thread (measured: a task's bits followed
# the thread it ran on), so such tasks get zero rows up to 4.
MIN_TASK_ROWS = 4


def task_tokens(group_size: int) -> int:
    """Token slots per task: as many whole tokens' G query heads as ``TASK_ROWS`` holds."""
    return max(1, TASK_ROWS // group_size)


def task_rows(group_size: int, tokens: int) -> int:
    """Query rows of every task: its slots' G heads each, at least ``MIN_TASK_ROWS``."""
    return max(group_size * tokens, MIN_TASK_ROWS)


class SpanCall(NamedTuple):
    """Tasks of groups ``[first_group, first_group + num_groups)`` in one call: one task
    per group (new tokens of one each) or, for a run (``num_groups == 1``), all tasks
    over the same group."""

    first_group: int
    num_groups: int
    slots: torch.Tensor  # [tasks, slots_per_task] query rows; num_tokens: an empty slot
    bias: torch.Tensor  # [tasks, 1, rows, S] fp32: 0 for keys up to the row's token


class SpanMetadata(NamedTuple):
    """A step's span plan (see the module docstring); shared by all its layers."""

    span: int
    slots_per_task: int
    block_size: int
    group_size: int  # query heads per KV head
    num_tokens: int
    batch: int
    block_ids: torch.Tensor  # [groups, S // block_size] int64 (past the context: 0)
    keys_outside: torch.Tensor  # [n] int64 rows of the gathered [groups * S] past the context
    calls: tuple[SpanCall, ...]  # states: call after call, task by task, slot by slot
    num_states: int
    direct_rows: torch.Tensor  # [a] query rows with one span ...
    direct_states: torch.Tensor  # [a] ... and their state
    merge_rows: torch.Tensor  # [m] query rows with several spans ...
    merge_states: torch.Tensor  # [m, n] ... their states in span order (pads: 0)
    merge_valid: torch.Tensor  # [m, n] bool: which are real


class _Group(NamedTuple):
    seq: int
    span: int
    token_start: int  # the first query row that reaches this span
    token_stop: int
    first_position: int  # that row's position


def span_metadata(
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    group_size: int,
    span: int | None = None,
    slots_per_task: int | None = None,
) -> SpanMetadata:
    """The plan of one step. ``span``: keys per span, a multiple of ``block_size`` (None:
    ``kernels.invariance.SPAN_TOKENS``, read at call time); ``slots_per_task`` None:
    ``task_tokens(group_size)``."""
    span = invariance.SPAN_TOKENS if span is None else span
    if span <= 0 or span % block_size:
        raise ValueError(f"span {span} must be a positive multiple of block_size {block_size}")
    per_task = task_tokens(group_size) if slots_per_task is None else slots_per_task
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    num_tokens = starts[-1]
    groups = _groups(starts, lens, span)
    singles = [g for g in groups if g.token_stop - g.token_start == 1]
    runs = [g for g in groups if g.token_stop - g.token_start > 1]
    device = block_tables.device
    # Each call: (its first group, its groups, its tasks as (group, query row) per filled
    # slot). Single-token groups: one call, a task each; a run: ``per_task`` tokens to a
    # task in order, one call per run.
    plans = [(0, len(singles), [[(g, g.token_start)] for g in singles])] if singles else []
    for i, g in enumerate(runs):
        tokens = [(g, t) for t in range(g.token_start, g.token_stop)]
        tasks = [tokens[k : k + per_task] for k in range(0, len(tokens), per_task)]
        plans.append((len(singles) + i, 1, tasks))
    state_of: dict[tuple[int, int], int] = {}  # (query row, span) -> its state
    calls = []
    num_states = 0
    for first_group, num_groups, tasks in plans:
        rows, positions, spans = [], [], []
        for task in tasks:
            g = task[0][0]
            for k in range(per_task):
                if k < len(task):
                    state_of[(task[k][1], g.span)] = num_states + len(rows)
                    rows.append(task[k][1])
                    positions.append(g.first_position + task[k][1] - g.token_start)
                else:  # an empty slot: a zero row that sees the span's first key
                    rows.append(num_tokens)
                    positions.append(g.span * span)
            spans.append(g.span)
        bias = _bias(positions, spans, span, group_size, per_task, device)
        slots = torch.tensor(rows, dtype=torch.int64, device=device).view(-1, per_task)
        calls.append(SpanCall(first_group, num_groups, slots, bias))
        num_states += len(rows)
    block_ids, keys_outside = _keys(singles + runs, block_tables, lens, block_size, span)
    return SpanMetadata(
        span,
        per_task,
        block_size,
        group_size,
        num_tokens,
        len(lens),
        block_ids,
        keys_outside,
        tuple(calls),
        num_states,
        *_assembly(starts, lens, span, state_of, device),
    )


def _groups(starts: list[int], lens: list[int], span: int) -> list[_Group]:
    """Every sequence's spans that its new tokens reach, sequence by sequence."""
    groups = []
    for b, context_len in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        prefix = context_len - q_len
        for j in range((context_len - 1) // span + 1 if q_len else 0):
            first = max(prefix, j * span)
            groups.append(_Group(b, j, starts[b] + first - prefix, starts[b + 1], first))
    return groups


def _bias(
    positions: list[int], spans: list[int], span: int, group_size: int, per_task: int, device
) -> torch.Tensor:
    """``[tasks, 1, rows, S]``: 0 where the span's key is at or before the row's token
    (a slot's G rows share its token; padding rows repeat the last slot's)."""
    first_key = torch.tensor(spans, device=device).repeat_interleave(per_task) * span
    keys = first_key[:, None] + torch.arange(span, device=device)[None, :]
    visible = keys <= torch.tensor(positions, device=device)[:, None]  # [tasks * slots, S]
    per_row = visible.view(-1, per_task, 1, span).expand(-1, -1, group_size, -1)
    per_row = per_row.reshape(-1, per_task * group_size, span)
    rows = task_rows(group_size, per_task)
    if rows > per_row.shape[1]:
        pad = per_row[:, -1:].expand(-1, rows - per_row.shape[1], -1)
        per_row = torch.cat([per_row, pad], dim=1)
    bias = torch.zeros(per_row.shape, dtype=torch.float32, device=device)
    return bias.masked_fill_(~per_row, float("-inf"))[:, None]


def _keys(
    groups: list[_Group],
    block_tables: torch.Tensor,
    lens: list[int],
    block_size: int,
    span: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's block ids, and the gathered rows past its sequence's context."""
    device = block_tables.device
    per_span = span // block_size
    seqs = torch.tensor([g.seq for g in groups], dtype=torch.int64, device=device)
    first = torch.tensor([g.span * per_span for g in groups], dtype=torch.int64, device=device)
    columns = first[:, None] + torch.arange(per_span, device=device)[None, :]
    group_lens = torch.tensor(lens, dtype=torch.int64, device=device).index_select(0, seqs)
    inside = columns < ((group_lens + block_size - 1) // block_size)[:, None]
    width = block_tables.shape[1]
    ids = block_tables.long()[seqs[:, None], columns.clamp(max=max(width - 1, 0))]
    ids = torch.where(inside, ids, torch.zeros_like(ids))
    positions = first[:, None] * block_size + torch.arange(span, device=device)[None, :]
    outside = (positions >= group_lens[:, None]).view(-1).nonzero().view(-1)
    return ids, outside


def _assembly(
    starts: list[int], lens: list[int], span: int, state_of: dict[tuple[int, int], int], device
) -> tuple[torch.Tensor, ...]:
    """Where each query row's output comes from: its one state, or its states to merge
    (``direct_rows`` .. ``merge_valid`` of ``SpanMetadata``)."""
    direct: list[int] = []
    merged: list[tuple[int, int]] = []  # (query row, its number of spans)
    for b, context_len in enumerate(lens):
        prefix = context_len - (starts[b + 1] - starts[b])
        for t in range(starts[b], starts[b + 1]):
            num_spans = (prefix + t - starts[b]) // span + 1
            if num_spans == 1:
                direct.append(t)
            else:
                merged.append((t, num_spans))
    width = max((n for _, n in merged), default=1)
    merge_states = [[state_of[(t, j)] for j in range(n)] + [0] * (width - n) for t, n in merged]
    merge_valid = [[j < n for j in range(width)] for _, n in merged]

    def ints(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return (
        ints(direct),
        ints([state_of[(t, 0)] for t in direct]),
        ints([t for t, _ in merged]),
        ints(merge_states).view(len(merged), width),
        torch.tensor(merge_valid, dtype=torch.bool, device=device).view(len(merged), width),
    )


def check_span_metadata(
    metadata: SpanMetadata, num_tokens: int, batch: int, block_size: int, group_size: int
) -> None:
    """Raise ``ValueError`` unless ``metadata`` was built for this step's shapes."""
    if not isinstance(metadata, SpanMetadata):
        raise ValueError(f"metadata must be a SpanMetadata, got {type(metadata).__name__}")
    built = (metadata.num_tokens, metadata.batch, metadata.block_size, metadata.group_size)
    if built != (num_tokens, batch, block_size, group_size):
        raise ValueError(
            "metadata built for tokens / batch / block_size / group "
            f"{built}, got {(num_tokens, batch, block_size, group_size)}"
        )
