"""Warm-up: the step shapes the scheduler will use, run once before the engine is ready.

A fresh process pays first-call costs in the first forward of each shape
(kernel primitives and weight reorders per linear shape where oneDNN runs,
Triton compiles per specialisation on a GPU, allocator growth up to a full
chunk's activations, the native library's first pages) and in the sampler's
first calls. Paid by the first requests, they make the first turn after every
deploy the slow one; paid here, before ``/readyz`` turns green, they are paid
behind the load balancer.

Nothing here touches the cache: every new token's slot is -1 (its K/V is not
written) and every block table names block 0 of the pool, which is read and
never written. So the cache's blocks, index and statistics are exactly as the
engine built them (tests/engine/test_warmup.py), and the forward's output is
thrown away. With a disk tier, one shape is a disk load instead of a forward: a
scratch block file written and read back into a free pool block through the
tier's load path, holding that block's own bytes (``kv_disk/probe.py``), so it
changes nothing either. The shapes go most common first (a decode of one, a full
prefill chunk, a new turn's extend, the disk load a returning session's turn
starts with, then decode batches doubling to ``max_num_seqs``, a mixed step); a
time budget bounds the whole run: a shape is not started once the budget is spent.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chatsvc.engine.forward_batch import ForwardBatch
from chatsvc.engine.llama import LlamaModel
from chatsvc.engine.sampling import make_generator, sample_rows
from chatsvc.protocol import SamplingParams

# The history a warm-up sequence attends over: a few blocks, as a turn's would.
CONTEXT_TOKENS = 256
# Sampling options of the draws that follow a forward: greedy, and the sampled path.
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9, top_k=50)
# A disk shape started near the end of the budget still gets this long to finish.
DISK_LOAD_MIN_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class Shape:
    """One step: ``num_decodes`` sequences of one new token and, when ``chunk`` > 0, one
    sequence computing ``chunk`` new tokens; each after ``context`` cached tokens but
    a prefill (``chunk`` with ``context`` 0 and no decodes). ``disk``: a disk load of
    one block instead of a forward."""

    name: str
    num_decodes: int = 0
    chunk: int = 0
    context: int = 0
    disk: bool = False


@dataclass(frozen=True, slots=True)
class WarmedShape:
    name: str
    seconds: float


def warm_up_shapes(
    max_num_seqs: int, max_batched_tokens: int, max_context: int, disk_load: bool = False
) -> list[Shape]:
    """The shapes to run, most common first, each fitting the scheduler's limits and
    ``max_context`` tokens of context; with ``disk_load``, a disk load among them."""
    chunk = min(max_batched_tokens, max_context - 1)
    # Room for the longest chunk after the context (a table never passes the context).
    context = max(1, min(CONTEXT_TOKENS, max_context - chunk - 1))
    shapes = [Shape("decode x1", num_decodes=1, context=context)]
    if chunk > 1:
        shapes.append(Shape(f"prefill {chunk}", chunk=chunk))
        extend = min(64, chunk)
        shapes.append(Shape(f"extend {extend} after {context}", chunk=extend, context=context))
    if disk_load:
        shapes.append(Shape("disk load", disk=True))
    batch = 2
    while batch <= min(max_num_seqs, max_batched_tokens):
        shapes.append(Shape(f"decode x{batch}", num_decodes=batch, context=context))
        batch *= 2
    decodes = min(max_num_seqs - 1, max_batched_tokens // 2)
    mixed = min(max_batched_tokens - decodes, chunk)
    if decodes >= 1 and mixed > 1:
        shapes.append(Shape(f"decode x{decodes} + chunk {mixed}", decodes, mixed, context))
    return shapes


def run_warm_up(
    model: LlamaModel,
    kv_pool: torch.Tensor,
    block_size: int,
    shapes: list[Shape],
    budget_s: float,
    stop: Callable[[], bool] | None = None,
    disk_load: Callable[[float], str] | None = None,
) -> list[WarmedShape]:
    """Run ``shapes`` in order until ``budget_s`` is spent or ``stop()`` is true (checked
    before each shape: a shutdown waits for one shape at most); what ran and how long
    each took. ``disk_load(timeout_s)`` runs a disk shape ("ok" or what failed, which
    the shape's name then carries)."""
    done: list[WarmedShape] = []
    began = time.perf_counter()
    for shape in shapes:
        spent = time.perf_counter() - began
        if spent >= budget_s or (stop is not None and stop()):
            break
        start = time.perf_counter()
        name = shape.name
        if shape.disk:
            if disk_load is None:
                continue
            outcome = disk_load(max(budget_s - spent, DISK_LOAD_MIN_TIMEOUT_S))
            if outcome != "ok":
                name = f"{name} ({outcome})"
        else:
            logits = model.forward(_batch(shape, block_size, model.device), kv_pool)
            _sample(logits)
        done.append(WarmedShape(name, time.perf_counter() - start))
    return done


def _batch(shape: Shape, block_size: int, device: torch.device) -> ForwardBatch:
    token_ids: list[list[int]] = []
    computed: list[int] = []
    for _ in range(shape.num_decodes):
        token_ids.append([1])
        computed.append(shape.context)
    if shape.chunk:
        # Distinct ids: the embedding lookup gathers rows as a real prompt's does.
        token_ids.append([1 + i % 100 for i in range(shape.chunk)])
        computed.append(shape.context)
    pairs = zip(token_ids, computed, strict=True)
    tables = [[0] * math.ceil((done + len(new)) / block_size) for new, done in pairs]
    slots = [[-1] * len(new) for new in token_ids]
    return ForwardBatch.from_lists(token_ids, computed, slots, tables, block_size, device)


def _sample(logits: torch.Tensor) -> None:
    """Both sampler paths on the step's rows (block 0's contents may be anything: the
    rows are made finite first, as real logits are)."""
    logits = torch.nan_to_num(logits.float(), nan=0.0, posinf=0.0, neginf=0.0)
    rows = logits.shape[0]
    params = [GREEDY if row % 2 == 0 else SAMPLED for row in range(rows)]
    generators = [None if p.is_greedy else make_generator(0) for p in params]
    sample_rows(logits, params, generators)
