"""The linear layers of one forward step on the CPU, per weight layout, bf16.

    .venv/bin/python -m bench.linear [--rows 1,16,48,128,512] [--rounds 10]

Every call runs the matrices of all 30 layers of SmolLM2-135M (qkv, o, gate_up, down:
212 MB of bf16 weights, random), so the weights come from memory as in a step, for
``--rows`` input rows (the step's new tokens). Layouts: plain (``F.linear``),
oneDNN-prepacked (torch's ``_linear_pointwise``, where oneDNN runs bf16) and, on CPUs
with a tile unit, the tile layout of ``kernels.cpu.tile_linear``; the down projection adds
the residual in each, as the model does. They run interleaved, round by round;
medians are printed with the weights' read rate. Figures, not assertions.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.model_step import interleaved_medians
from kernels.cpu.tile_linear import tile_linear_available
from kernels.linear import LINEARS, can_prepack

LAYERS = 30
HIDDEN, INTERMEDIATE, QKV = 576, 1536, 576 + 2 * 192
# (out features, in features, adds the residual)
MATRICES = [(QKV, HIDDEN, False), (HIDDEN, HIDDEN, True), (2 * INTERMEDIATE, HIDDEN, False),
            (HIDDEN, INTERMEDIATE, True)]  # fmt: skip


def layout_fns(rows: int, seed: int = 0) -> dict[str, Callable[[], torch.Tensor]]:
    """One step's linears per layout by name; each returns its last output."""
    gen = torch.Generator().manual_seed(seed)
    plain = [
        [(torch.randn(n, k, generator=gen) / k**0.5).bfloat16() for n, k, _ in MATRICES]
        for _ in range(LAYERS)
    ]
    inputs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k, _ in MATRICES}
    residual = torch.randn(rows, HIDDEN, generator=gen).bfloat16()

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
    if can_prepack(torch.device("cpu"), torch.bfloat16):
        fns["onednn"] = run("onednn")
    if tile_linear_available("cpu", torch.bfloat16):
        fns["tiles"] = run("tiles")
    return fns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,48,128,512")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    megabytes = LAYERS * sum(n * k * 2 for n, k, _ in MATRICES) / 1e6
    print(f"threads {torch.get_num_threads()}, {megabytes:.0f} MB of weights per step")
    if not can_prepack(torch.device("cpu"), torch.bfloat16):
        print("oneDNN runs no bf16 here (no AVX-512): the plain layout only")
    if not tile_linear_available("cpu", torch.bfloat16):
        print("no tile unit (AMX) here: no tile layout")
    for rows in (int(r) for r in args.rows.split(",")):
        ms = interleaved_medians(layout_fns(rows), args.rounds)
        line = f"rows {rows:>4}: " + " | ".join(
            f"{name} {t:6.2f} ms ({megabytes / t:5.1f} GB/s)" for name, t in ms.items()
        )
        if "tiles" in ms and "onednn" in ms:
            line += f" | tiles / onednn {ms['tiles'] / ms['onednn']:.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
