"""Paged attention per layer on the torch path: invariant spans vs the grouped SDPA calls.

    .venv/bin/python -m bench.torch_attention [--dtype bf16|fp32] [--rounds 10] [--threads N]

The torch backend attends one of two ways (``kernels.invariance``): by default in fixed
tasks per span of ``SPAN_TOKENS`` keys (``kernels.span_attention``, a token's bits
independent of its step), with ``invariant=False`` in padded SDPA groups shaped by the
step (``kernels.extend_metadata``). Each case is one step's attention over a pool shaped
like SmolLM2-135M's (30 layers, 9 query / 3 KV heads of 64, blocks of 16); every call
walks all 30 layers, so K/V come from memory, and each path's per-step metadata is
built once per call, as a bound step builds it. The two run interleaved, round by
round; medians per layer are printed as a markdown table. Figures, not assertions.
glibc's malloc is set as the engine sets it (``chatsvc.engine.allocator``): without it
the fresh pages of every gathered copy cost more than the attention.
"""

from __future__ import annotations

import argparse
import math

import torch

from bench.model_step import interleaved_medians
from chatsvc.engine.allocator import keep_freed_memory
from kernels.extend_attention import attend_groups
from kernels.extend_metadata import extend_metadata
from kernels.span_attention import attend_spans
from kernels.span_metadata import span_metadata

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16

# (label, new tokens per sequence, context per sequence, sequences)
CASES = [
    ("decode", 1, 400, 8),
    ("decode", 1, 1000, 16),
    ("decode", 1, 1000, 1),
    ("decode", 1, 4000, 1),
    ("extend", 4, 600, 8),
    ("extend", 32, 600, 8),
    ("prefill", 256, 256, 1),
    ("prefill", 512, 512, 1),
    ("chunk", 256, 1280, 1),
]


def case_fns(q_len: int, context: int, batch: int, dtype: torch.dtype):
    """The two paths of one case by name, each returning its last layer's output."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    shape = (batch * per_seq + 1, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)
    pool = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
    tables = order.to(torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32) * q_len
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch * q_len, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = 1 / math.sqrt(HEAD_DIM)
    group = Q_HEADS // KV_HEADS
    row_bytes = KV_HEADS * HEAD_DIM * pool.element_size()

    def grouped() -> torch.Tensor:
        metadata = extend_metadata(tables, starts, lens, BLOCK, group, row_bytes, dtype)
        out = torch.empty_like(query)
        for index in range(LAYERS):
            attend_groups(query, pool[:, index, 0], pool[:, index, 1], metadata, scale, out)
        return out

    def spans() -> torch.Tensor:
        metadata = span_metadata(tables, starts, lens, BLOCK, group)
        for index in range(LAYERS):
            out = attend_spans(query, pool[:, index, 0], pool[:, index, 1], metadata, scale)
        return out

    return {"grouped": grouped, "spans": spans}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp32", choices=["bf16", "fp32"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    args = parser.parse_args()
    keep_freed_memory()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(f"dtype {dtype}, threads {torch.get_num_threads()}, ms per layer (median)\n")
    head = "| step | new tokens | context | sequences | grouped | spans | spans / grouped |"
    print(head)
    print("|---" * head.count(" |") + "|")
    for label, q_len, context, batch in CASES:
        fns = case_fns(q_len, context, batch, dtype)
        ms = interleaved_medians(fns, args.rounds)
        grouped, spans = ms["grouped"] / LAYERS, ms["spans"] / LAYERS
        print(
            f"| {label} | {q_len} | {context} | {batch} | {grouped:.3f} | {spans:.3f} "
            f"| {spans / grouped:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
