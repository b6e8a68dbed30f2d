"""The invariant Triton kernels on CUDA: their checks, and their time against what they replace.

    python -m bench.triton_spans [--skip-checks] [--skip-times]

1. Checks (each prints PASS or FAIL): ``bench.gpu_invariance``'s kernel rows (span
   attention over chunkings and companions, matmul rows, RMSNorm rows; fp32 and bf16),
   and the span kernel, the matmul and RMSNorm against their torch references.
2. Times (``triton.testing.do_bench`` medians, ms per call), markdown tables: the span kernel
   against the flash-decoding decode kernel (partitions by the SM count) and the extend
   kernel; the matmul against ``F.linear`` (cuBLAS); bf16.

Without a CUDA device it says so and exits 0. Exit status: failed checks.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

from bench.gpu_invariance import _attention_rows, _matmul_rows, _rms_norm_rows

# (label, query heads, KV heads, head dim)
MODELS = [("SmolLM2-135M", 9, 3, 64), ("Llama-3-8B", 32, 8, 128)]
DECODES = [(1, 1024), (1, 8192), (32, 1024), (32, 8192), (128, 1024), (128, 8192)]
# (new tokens, cached prefix)
EXTENDS = [(512, 4096), (2048, 0)]
# (M, N, K): SmolLM2's gate_up and Llama-3-8B's gate_up and down projections
MATMULS = [
    (m, n, k) for n, k in ((3072, 576), (28672, 4096), (4096, 14336)) for m in (1, 32, 512, 4096)
]
BLOCK = 16


def _case(batch, q_len, context, q_heads, kv_heads, head_dim, dtype=torch.bfloat16):
    from kernels.attention_inputs import AttentionInputs

    gen = torch.Generator(device="cuda").manual_seed(0)
    per_seq = -(-context // BLOCK)
    shape = (batch * per_seq, BLOCK, kv_heads, head_dim)
    k = torch.randn(shape, device="cuda", generator=gen, dtype=dtype)
    v = torch.randn(shape, device="cuda", generator=gen, dtype=dtype)
    tables = torch.randperm(batch * per_seq, device="cuda", generator=gen)
    tables = tables.view(batch, per_seq).to(torch.int32)
    query = torch.randn(batch * q_len, q_heads, head_dim, device="cuda", dtype=dtype)
    starts = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * q_len
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return AttentionInputs(query, k, v, tables, starts, lens, 1 / math.sqrt(head_dim))


def run_checks() -> int:
    import kernels
    from kernels.matmul import matmul, matmul_torch
    from kernels.rms_norm import rms_norm_torch, rms_norm_triton

    failures = 0
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows += [
            _attention_rows("triton", dtype, "cuda"),
            _matmul_rows(dtype, "cuda"),
            _rms_norm_rows("triton", dtype, "cuda"),
        ]
    print("| part | dtype | rows compared | result |\n|---|---|---|---|")
    for line, ok in rows:
        print(line)
        failures += not ok
    tolerance = {torch.float32: 2e-4, torch.bfloat16: 2.5e-2}
    for dtype in (torch.float32, torch.bfloat16):
        for label, q_heads, kv_heads, head_dim in MODELS:
            inputs = _case(3, 40, 700, q_heads, kv_heads, head_dim, dtype)
            args = tuple(inputs)
            got = kernels.paged_extend_attention(*args, backend="triton")
            ref = kernels.paged_extend_attention(*args, backend="torch")
            err = (got.float() - ref.float()).abs().max().item()
            ok = err <= tolerance[dtype] * max(1.0, ref.float().abs().max().item())
            print(f"span kernel vs torch spans, {label} {dtype}: max error {err:.2e}", ok)
            failures += not ok
        x = torch.randn(300, 576, device="cuda").to(dtype)
        w = torch.randn(1536, 576, device="cuda").to(dtype)
        b = torch.randn(1536, device="cuda").to(dtype)
        r = torch.randn(300, 1536, device="cuda").to(dtype)
        ref = matmul_torch(x, w, b, r).float()
        err = (matmul(x, w, b, r).float() - ref).abs().max().item()
        ok = err <= tolerance[dtype] * max(1.0, ref.abs().max().item())
        print(f"matmul vs torch, {dtype}: max error {err:.2e}", ok)
        failures += not ok
        xn = (torch.randn(300, 576, device="cuda") * 3).to(dtype)
        wn = torch.randn(576, device="cuda").to(dtype)
        err = rms_norm_triton(xn, wn, 1e-5).float() - rms_norm_torch(xn, wn, 1e-5).float()
        err = err.abs().max().item()
        ok = err <= tolerance[dtype] * 4
        print(f"rms_norm vs torch, {dtype}: max error {err:.2e}", ok)
        failures += not ok
    return failures


def run_times() -> None:
    from triton.testing import do_bench

    from kernels.decode_attention import paged_decode_attention_triton
    from kernels.extend_attention import paged_extend_attention_triton
    from kernels.matmul import matmul
    from kernels.span_attention_triton import paged_attention_spans_triton

    def ms(fn) -> float:
        return do_bench(fn, warmup=10, rep=50, return_mode="median")

    head = "| model | step | batch | new tokens | context | spans | previous | spans / previous |"
    print("\n" + head + "\n" + "|---" * 8 + "|")

    def row(*cells) -> None:
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)

    for label, q_heads, kv_heads, head_dim in MODELS:
        for batch, context in DECODES:
            inputs = _case(batch, 1, context, q_heads, kv_heads, head_dim)
            decode = inputs._replace(query_start_loc=None)
            new = ms(lambda i=inputs: paged_attention_spans_triton(i, 1))
            old = ms(lambda i=decode: paged_decode_attention_triton(i))
            row(label, "decode", batch, 1, context, f"{new:.3f}", f"{old:.3f}", f"{new / old:.2f}")
        for q_len, prefix in EXTENDS:
            inputs = _case(1, q_len, prefix + q_len, q_heads, kv_heads, head_dim)
            new = ms(lambda i=inputs, n=q_len: paged_attention_spans_triton(i, n))
            old = ms(lambda i=inputs, n=q_len: paged_extend_attention_triton(i, n))
            ratio = f"{new / old:.2f}"
            row(label, "extend", 1, q_len, prefix + q_len, f"{new:.3f}", f"{old:.3f}", ratio)
        del inputs
        torch.cuda.empty_cache()
    print("\n| M | N | K | matmul | F.linear | matmul / F.linear |\n" + "|---" * 6 + "|")
    for m, n, k in MATMULS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        new = ms(lambda x=x, w=w: matmul(x, w))
        old = ms(lambda x=x, w=w: F.linear(x, w))
        row(m, n, k, f"{new:.3f}", f"{old:.3f}", f"{new / old:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--skip-times", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device is present: nothing to check or time.")
        return 0
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    failures = 0 if args.skip_checks else run_checks()
    if not args.skip_times:
        run_times()
    return failures


if __name__ == "__main__":
    sys.exit(main())
