"""Schedules for the attention invariance tests: one set of sequences computed in many steps.

Every sequence of a ``PagedCase`` has all its K/V in the pool and one query row per
token. A *piece* is a run of its new tokens, ``[start, stop)``, attended with context
``stop`` (the tokens before ``start`` play the cached prefix); a *step* is one kernel
call holding some pieces, of any sequences, in any order. A schedule cuts every
sequence into pieces (chunks, single-token decodes) and deals them into steps beside
other sequences' pieces. The property: every row's output is bit-identical to the row of
the sequence attended alone in one piece. Keys past a piece's context are NaN in the
step's pool, so a kernel that let one into a sum would show it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

import torch
from kernel_cases import PagedCase

# attend(query, k_cache, v_cache, block_tables, query_start_loc, context_lens) -> out
Attend = Callable[..., torch.Tensor]


class Piece(NamedTuple):
    seq: int
    start: int  # first new token's position
    stop: int  # the step's context length for this sequence


def attend_pieces(
    attend: Attend, case: PagedCase, queries: list[torch.Tensor], pieces: list[Piece]
) -> list[torch.Tensor]:
    """One step holding ``pieces`` in order; each piece's output rows."""
    pool = case.pool.clone()
    k_cache, v_cache = _layer(case, pool)
    for piece in pieces:  # keys past each piece's context: NaN, never to be read
        positions = torch.arange(piece.stop, case.context_lens[piece.seq].item())
        blocks = case.block_tables[piece.seq, positions // case.block_size].long()
        k_cache[blocks, positions % case.block_size] = float("nan")
        v_cache[blocks, positions % case.block_size] = float("nan")
    query = torch.cat([queries[p.seq][p.start : p.stop] for p in pieces])
    sizes = torch.tensor([p.stop - p.start for p in pieces])
    starts = torch.zeros(len(pieces) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(sizes, 0)
    tables = case.block_tables[[p.seq for p in pieces]]
    lens = torch.tensor([p.stop for p in pieces], dtype=torch.int32)
    out = attend(query, k_cache, v_cache, tables, starts, lens)
    return [out[starts[i] : starts[i + 1]] for i in range(len(pieces))]


def _layer(case: PagedCase, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pool``'s views at the same layer as ``case.k_cache`` / ``case.v_cache``."""
    offset = case.k_cache.storage_offset() - case.pool.storage_offset()
    k = pool.as_strided(case.k_cache.shape, case.k_cache.stride(), pool.storage_offset() + offset)
    offset = case.v_cache.storage_offset() - case.pool.storage_offset()
    v = pool.as_strided(case.v_cache.shape, case.v_cache.stride(), pool.storage_offset() + offset)
    return k, v


def random_schedule(rng: random.Random, lens: list[int], max_cuts: int = 4) -> list[list[Piece]]:
    """Every sequence cut at random points (some runs of one token: decodes), the pieces
    dealt into steps in order per sequence, each step's pieces shuffled."""
    queues = []
    for seq, n in enumerate(lens):
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, max_cuts))))
        bounds = [0, *cuts, n]
        queues.append([Piece(seq, a, b) for a, b in zip(bounds, bounds[1:], strict=False)])
    steps = []
    while any(queues):
        step = [q.pop(0) for q in queues if q and rng.random() < 0.7]
        if not step:
            step = [next(q for q in queues if q).pop(0)]
        rng.shuffle(step)
        steps.append(step)
    return steps


def mismatches(
    attend: Attend,
    case: PagedCase,
    queries: list[torch.Tensor],
    steps: list[list[Piece]],
    alone: list[torch.Tensor] | None = None,
) -> list[tuple[Piece, int]]:
    """(piece, rows that differ) of every piece whose rows are not bit-identical to the same
    rows of its sequence attended alone in one piece (``alone``: those, if computed)."""
    if alone is None:
        alone = solo_outputs(attend, case, queries)
    bad = []
    for step in steps:
        for piece, out in zip(step, attend_pieces(attend, case, queries, step), strict=True):
            expected = alone[piece.seq][piece.start : piece.stop]
            same = (out == expected) | (out.isnan() & expected.isnan())
            rows = int((~same.flatten(1).all(dim=1)).sum())
            if rows:
                bad.append((piece, rows))
    return bad


def solo_outputs(attend: Attend, case: PagedCase, queries: list[torch.Tensor]):
    """Each sequence attended alone, all its tokens in one piece."""
    lens = case.context_lens.tolist()
    return [
        attend_pieces(attend, case, queries, [Piece(seq, 0, n)])[0] for seq, n in enumerate(lens)
    ]
