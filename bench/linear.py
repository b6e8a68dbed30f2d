"""The linear layers of one forward step on the CPU, per weight layout.

    .venv/bin/python -m bench.linear [--dtype bf16|fp32] [--rows 1,16,48,128,512] [--rounds 10]

Every call runs the matrices of all 30 layers of SmolLM2-135M (qkv, o, gate_up, down:
106M random weights, values bf16 holds), so the weights come from memory as in a step,
for ``--rows`` input rows (the step's new tokens). Layouts: plain (``F.linear``),
oneDNN-prepacked (torch's ``_linear_pointwise``; in bf16 where oneDNN runs it), in bf16
on CPUs with a tile unit the tile layout of ``kernels.cpu.tile_linear``, in fp32 on CPUs
with AVX2 the bf16- and int8-stored weights of ``kernels.cpu.narrow_linear``; the down projection
adds the residual in each, as the model does. They run interleaved, round by round;
medians are printed with the rate at which each layout reads its weights' bytes.
Figures, not assertions.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.model_step import interleaved_medians
from kernels.cpu.narrow_linear import narrow_linear_available
from kernels.cpu.pair_linear import pair_linear_available
from kernels.cpu.tile_linear import tile_linear_available
from kernels.linear import LINEARS, can_prepack

LAYERS = 30
HIDDEN, INTERMEDIATE, QKV = 576, 1536, 576 + 2 * 192
# (out features, in features, adds the residual)
MATRICES = [(QKV, HIDDEN, False), (HIDDEN, HIDDEN, True), (2 * INTERMEDIATE, HIDDEN, False),
            (HIDDEN, INTERMEDIATE, True)]  # fmt: skip


# Bytes per weight each layout reads, by the model's dtype.
WEIGHT_BYTES = {
    "plain": None,
    "onednn": None,
    "tiles": 2,
    "pair_blocks": 2,
    "bf16_blocks": 2,
    "int8_blocks": 1,
}


def layout_fns(
    rows: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, Callable[[], torch.Tensor]]:
    """One step's linears per layout by name; each returns its last output."""
    gen = torch.Generator().manual_seed(seed)
    plain = [
        [(torch.randn(n, k, generator=gen) / k**0.5).bfloat16().to(dtype) for n, k, _ in MATRICES]
        for _ in range(LAYERS)
    ]
    inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k, _ in MATRICES}
    residual = torch.randn(rows, HIDDEN, generator=gen).to(dtype)

    def run(layout: str) -> Callable[[], torch.Tensor]:
        linears = LINEARS[layout]
        mm, mm_add = linears.linear, linears.linear_add
        weights = [[linears.pack(w) for w in layer] for layer in plain]

        def step() -> torch.Tensor:
            for layer in weights:
                for (_, k, adds), w in zip(MATRICES, layer, strict=True):
                    out = mm_add(inputs[k], w, residual) if adds else mm(inputs[k], w)
            return out

        return step

    fns = {"plain": run("plain")}
    if can_prepack(torch.device("cpu"), dtype):
        fns["onednn"] = run("onednn")
    if tile_linear_available("cpu", dtype):
        fns["tiles"] = run("tiles")
    if pair_linear_available("cpu", dtype):
        fns["pair_blocks"] = run("pair_blocks")
    if narrow_linear_available("cpu", dtype):
        fns["bf16_blocks"] = run("bf16_blocks")
        fns["int8_blocks"] = run("int8_blocks")
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--rows", default="1,16,48,128,512")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    weights = LAYERS * sum(n * k for n, k, _ in MATRICES)
    print(f"threads {torch.get_num_threads()}, {args.dtype}, {weights / 1e6:.0f}M weights per step")
    if not can_prepack(torch.device("cpu"), dtype):
        print(f"oneDNN runs no {args.dtype} here (no AVX-512): no oneDNN layout")
    for rows in (int(r) for r in args.rows.split(",")):
        ms = interleaved_medians(layout_fns(rows, dtype=dtype), args.rounds)
        parts = []
        for name, t in ms.items():
            megabytes = weights * (WEIGHT_BYTES[name] or dtype.itemsize) / 1e6
            parts.append(f"{name} {t:6.2f} ms ({megabytes / t:5.1f} GB/s)")
        line = f"rows {rows:>4}: " + " | ".join(parts)
        for fast in ("tiles", "pair_blocks", "bf16_blocks", "int8_blocks"):
            if fast in ms and "onednn" in ms:
                line += f" | {fast} / onednn {ms[fast] / ms['onednn']:.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
