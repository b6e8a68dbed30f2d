"""Paged attention per layer on the CPU: the native C kernel vs the torch reference path.

    .venv/bin/python -m bench.cpu_attention [--dtype bf16|fp32] [--rounds 10]
        [--baseline-flags "-mno-avx512bf16"]

Each case is a step's attention over a pool shaped like SmolLM2-135M's (30 layers,
9 query / 3 KV heads of 64, blocks of 16): every call walks all 30 layers, so
the K/V come from memory as in a forward pass, not from a cache warmed by the
previous call. The two paths run interleaved, round by round; the medians per
layer are printed as a markdown table. Figures, not assertions.

Cases with a shared prefix map every sequence's first blocks onto the same ones;
the C kernel then attends to them once per group of sequences on the tile unit
(bf16 with AMX; docs/kernels.md).

``--baseline-flags`` adds a column: the native kernel built with those extra
compiler flags (e.g. ``-mno-avx512bf16``: the path of CPUs without AVX512-BF16;
``-mno-amx-tile``: without the tile unit), run in the same rounds, so a kernel
change is measured against what it replaces.

``--kv-dtype int8`` measures an int8 KV cache instead (``kernels/kv_layout.py``): decodes
of one and of 16 sequences over ``--contexts`` tokens, the native kernel over the same
K/V in the model dtype and quantized to int8, interleaved:

    .venv/bin/python -m bench.cpu_attention --kv-dtype int8 [--contexts 500,1000,4000,16000]
"""

from __future__ import annotations

import argparse
import math

import torch

from bench.model_step import interleaved_medians
from chatsvc.engine.forward_batch import ForwardBatch
from kernels.attention_inputs import AttentionInputs
from kernels.cpu import native
from kernels.cpu.attention import paged_attention_native
from kernels.extend_attention import paged_extend_attention_torch
from kernels.extend_metadata import extend_metadata
from kernels.kv_layout import KVShape, layer_kv, new_kv_pool
from kernels.kv_quant import quantize_rows
from kernels.step.bind import StepDims, bind_step

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16

# (label, new tokens per sequence, context per sequence, sequences, shared prefix tokens)
CASES = [
    ("decode", 1, 400, 8, 0),
    ("decode", 1, 1000, 16, 0),
    ("decode", 1, 1000, 16, 512),
    ("decode", 1, 1500, 16, 512),
    ("decode", 1, 1000, 1, 0),
    ("decode", 1, 4000, 1, 0),
    ("extend", 2, 600, 8, 0),
    ("extend", 4, 600, 8, 0),
    ("extend", 4, 600, 8, 512),
    ("extend", 8, 600, 8, 0),
    ("extend", 16, 600, 8, 0),
    ("extend", 4, 1000, 1, 0),
    ("extend", 8, 1000, 1, 0),
    ("extend", 32, 600, 8, 0),
    ("extend", 32, 1000, 1, 0),
    ("extend", 48, 1000, 1, 0),
]


def case_fns(
    q_len: int, context: int, batch: int, dtype: torch.dtype, baseline=None, shared: int = 0
):
    """The paths of one case by name; ``baseline``: a second native library, if any;
    ``shared``: leading tokens (whole blocks) every sequence maps onto the same blocks,
    as the prefix cache maps a common system prompt."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    shape = (batch * per_seq + 1, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)
    pool = torch.randn(shape, generator=gen).to(dtype)
    # Blocks in shuffled order, as a busy cache hands them out.
    order = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
    tables = order.to(torch.int32)
    tables[:, : shared // BLOCK] = tables[0, : shared // BLOCK]
    starts = torch.arange(batch + 1, dtype=torch.int32) * q_len
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch * q_len, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = 1 / math.sqrt(HEAD_DIM)
    row_bytes = KV_HEADS * HEAD_DIM * pool.element_size()
    groups = extend_metadata(tables, starts, lens, BLOCK, Q_HEADS // KV_HEADS, row_bytes, dtype)
    seqs = torch.arange(batch, dtype=torch.int32)
    out = torch.empty_like(query)

    def layer(index: int) -> AttentionInputs:
        k, v = pool[:, index, 0], pool[:, index, 1]
        return AttentionInputs(query, k, v, tables, starts, lens, scale)

    def torch_path() -> torch.Tensor:
        for index in range(LAYERS):
            result = paged_extend_attention_torch(layer(index), groups)
        return result  # the last layer's, to check the two paths agree

    def native_path(lib=None):
        def run() -> torch.Tensor:
            for index in range(LAYERS):
                paged_attention_native(layer(index), seqs, out, lib)
            return out

        return run

    paths = {"torch": torch_path, "native": native_path()}
    if baseline is not None:
        paths["baseline"] = native_path(baseline)
    return paths


def kv_dtype_fns(context: int, batch: int, dtype: torch.dtype):
    """Decodes of ``batch`` sequences over ``context`` tokens: the native kernel over K/V
    in ``dtype`` ("float") and over the same K/V quantized to int8 ("int8"), called as the
    engine calls it: the step bound once (``kernels.step.bind_step``, the index tensors
    and the pool's addresses resolved there), then each layer's ``attention``."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 1
    shape = KVShape(LAYERS, BLOCK, KV_HEADS, HEAD_DIM)
    pools = {"float": new_kv_pool(num_blocks, shape, dtype, "cpu")}
    pools["int8"] = new_kv_pool(num_blocks, shape, torch.int8, "cpu")
    for index in range(LAYERS):
        floats, quantized = layer_kv(pools["float"], index), layer_kv(pools["int8"], index)
        for kv in (0, 1):
            values = torch.randn(floats[kv].shape, generator=gen).to(dtype)
            floats[kv].copy_(values)
            q, scale = quantize_rows(values)
            quantized[kv].copy_(q)
            quantized.scales[kv].copy_(scale)
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).to(torch.int32)
    # One new token per sequence at position context - 1; its KV write skipped (slot -1).
    step = ForwardBatch.from_lists(
        [[0]] * batch, [context - 1] * batch, [[-1]] * batch, tables.tolist(), BLOCK
    )
    query = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    dims = StepDims(Q_HEADS, HEAD_DIM**-0.5, 1e-5, dtype)

    def path(pool):
        def run() -> torch.Tensor:
            ops = bind_step(step, pool, dims, backend="native")
            for index in range(LAYERS):
                out = ops.attention(index, query)
            return out

        return run

    return {name: path(pool) for name, pool in pools.items()}


def compare_kv_dtypes(dtype: torch.dtype, contexts: list[int], rounds: int) -> None:
    head = (
        "| sequences | context | native, KV in the model dtype | native, int8 KV | int8 / float |"
    )
    print(f"dtype {dtype}, threads {torch.get_num_threads()}, decode ms per layer (median)\n")
    print(head)
    print("|---" * head.count(" |") + "|")
    for batch in (1, 16):
        for context in contexts:
            ms = interleaved_medians(kv_dtype_fns(context, batch, dtype), rounds)
            base, quant = ms["float"] / LAYERS, ms["int8"] / LAYERS
            print(
                f"| {batch} | {context} | {base:.3f} | {quant:.3f} | {quant / base:.2f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--baseline-flags",
        default="",
        help="extra compiler flags of a second native build to compare (space-separated)",
    )
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"])
    parser.add_argument("--contexts", default="500,1000,2000,4000,16000")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.kv_dtype == "int8":
        compare_kv_dtypes(dtype, [int(c) for c in args.contexts.split(",")], args.rounds)
        return
    baseline = None
    head = "| step | new tokens | context | sequences | shared | torch | native | native / torch |"
    if args.baseline_flags:
        flags = [*native.default_flags(), *args.baseline_flags.split()]
        baseline = native.load(native.build(native.default_compiler(), flags))
        head += f" native {args.baseline_flags} | native / that |"
    print(f"dtype {dtype}, threads {torch.get_num_threads()}, ms per layer (median)\n")
    print(head)
    print("|---" * head.count(" |") + "|")
    for label, q_len, context, batch, shared in CASES:
        fns = case_fns(q_len, context, batch, dtype, baseline, shared)
        ms = interleaved_medians(fns, args.rounds)
        torch_ms, native_ms = ms["torch"] / LAYERS, ms["native"] / LAYERS
        row = (
            f"| {label} | {q_len} | {context} | {batch} | {shared} | {torch_ms:.3f} "
            f"| {native_ms:.3f} "
            f"| {native_ms / torch_ms:.2f} |"
        )
        if baseline is not None:
            base_ms = ms["baseline"] / LAYERS
            row += f" {base_ms:.3f} | {native_ms / base_ms:.2f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
