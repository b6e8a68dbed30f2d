"""Decode-step and prefill time of our forward pass vs transformers' own, same model and input.

    .venv/bin/python -m bench.model_step [--model smollm2] [--dtype bf16|fp32] [--batches 1,8]
        [--steps 30] [--compare-backends] [--weight-dtypes onednn,fp32,bf16,int8]
        [--kv-dtypes auto,bf16,int8] [--compare-invariant]

For each batch size B: one decode step (B sequences, one new token each, after a
prompt of --context tokens) of our LlamaModel over the paged KV pool, with plain
weights, with oneDNN-prepacked ones and, where the CPU has a tile unit (bf16 with AMX),
with tile-packed ones (``kernels.cpu.tile_linear``, the default there: "prepacked" below
is the model's default layout), and of LlamaForCausalLM with its DynamicCache.
Then one prefill of --prefill tokens. The variants run interleaved, sample by
sample, so a shared machine's changing load hits them alike; medians are printed.
Figures, not assertions.

``--weight-dtypes`` (an fp32 model) times one model per weight dtype instead, each in
the layout ``CHATSVC_WEIGHT_DTYPE`` would give it (fp32, bf16 and int8: the narrow
blocks; ``onednn``: fp32 weights in oneDNN's layout, the fp32 path before the narrow
blocks, issue 27's baseline), and prints what a decode step reads (the matrices in
their layout and the context's KV) against the machine's read bandwidth, measured in
the same rounds (a sum over 512 MiB, interleaved with the steps): that time is the
step's floor. Each round runs a model's steps back to back, as a decode loop does
(``RUN`` of them), and prints two times: the steps of the run after its first, and the
first step of each run, which follows the 512 MiB sum or another model's steps with
nothing of its own left in the caches. Then each model's speed against the first one
listed, from the same rounds. ``--model random:qwen2.5-0.5b`` (a shape with seeded
random weights) reads 0.5-2 GB a step, so no cache holds a step's weights till the next.
``--kv-dtypes`` (``CHATSVC_KV_DTYPE``'s names) times each of those models over a KV pool
of each dtype (default: the model's own); a long ``--context`` makes the K/V a large part
of what a step reads.

``--compare-invariant`` times the default model twice, with invariant kernels (the
default, ``kernels.invariance``) and with the fastest kernels per step shape
(``CHATSVC_INVARIANT=0``, the kernels before invariance), side by side: decodes, a new
turn of ``--extend`` tokens over the context, and the prefill.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from chatsvc.engine.forward_batch import ForwardBatch
from chatsvc.engine.loader import LoadedModel, load_model
from kernels.backend import ENV_VAR
from kernels.cpu.narrow_linear import NarrowWeight
from kernels.cpu.tile_linear import TileWeight
from kernels.kv_layout import kv_dtype_for, new_kv_pool
from kernels.linear import can_prepack

BLOCK_SIZE = 16


def interleaved_medians(fns: dict[str, Callable[[], object]], steps: int) -> dict[str, float]:
    """Median ms of each function, timing them in turn within every round.

    Every other round runs them in reverse order: a function run right after another
    that read the same memory finds part of it in the last-level cache (a one-build
    A/B showed the second one faster), so a fixed order would favour the later ones.
    """
    return interleaved_runs(fns, steps, 1)[1]


def interleaved_runs(
    fns: dict[str, Callable[[], object]], rounds: int, run: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms per step of each function in runs of ``run`` calls, the functions taking
    turns run by run (the order reversed every other round, as in ``interleaved_medians``):
    the steps of each run after its first (empty for runs of one), and the first ones."""
    for fn in fns.values():
        fn()
    later: dict[str, list[float]] = {name: [] for name in fns}
    first: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else reversed(names):
            fn = fns[name]
            for i in range(run):
                start = time.perf_counter()
                fn()
                (later if i else first)[name].append(time.perf_counter() - start)
    median = statistics.median
    return (
        {name: median(t) * 1e3 for name, t in later.items() if t},
        {name: median(t) * 1e3 for name, t in first.items()},
    )


def _prompts(batch: int, length: int) -> torch.Tensor:
    return torch.randint(100, 40000, (batch, length), generator=torch.Generator().manual_seed(0))


def ours_decode(
    loaded: LoadedModel, batch: int, context: int, kv_dtype: str = "auto"
) -> Callable[[], object]:
    """A decode step at a fixed position (re-run: the context length stays the same), over
    a pool of ``kv_dtype`` (``CHATSVC_KV_DTYPE``'s names)."""
    model, bs = loaded.model, BLOCK_SIZE
    blocks_per_seq = context // bs + 1
    dtype = kv_dtype_for(kv_dtype, model.dtype)
    pool = new_kv_pool(batch * blocks_per_seq, model.kv_shape(bs), dtype, "cpu")
    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]

    def slots(b: int, start: int, end: int) -> list[int]:
        return [tables[b][p // bs] * bs + p % bs for p in range(start, end)]

    prompts = _prompts(batch, context).tolist()
    prefill_slots = [slots(b, 0, context) for b in range(batch)]
    model.forward(ForwardBatch.from_lists(prompts, [0] * batch, prefill_slots, tables, bs), pool)
    step_slots = [slots(b, context, context + 1) for b in range(batch)]
    step = ForwardBatch.from_lists([[7]] * batch, [context] * batch, step_slots, tables, bs)
    return lambda: model.forward(step, pool)


def with_backend(backend: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the kernels' default backend set to ``backend`` (kernels.backend)."""

    def run() -> object:
        previous = os.environ.get(ENV_VAR)
        os.environ[ENV_VAR] = backend
        try:
            return fn()
        finally:
            if previous is None:
                del os.environ[ENV_VAR]
            else:
                os.environ[ENV_VAR] = previous

    return run


def with_threads(num_threads: int, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        previous = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            return fn()
        finally:
            torch.set_num_threads(previous)

    return run


def ours_prefill(loaded: LoadedModel, length: int) -> Callable[[], object]:
    model, bs = loaded.model, BLOCK_SIZE
    num_blocks = -(-length // bs)
    pool = new_kv_pool(num_blocks, model.kv_shape(bs), model.dtype, "cpu")
    tokens = _prompts(1, length)[0].tolist()
    batch = ForwardBatch.from_lists(
        [tokens], [0], [list(range(length))], [list(range(num_blocks))], bs
    )
    return lambda: model.forward(batch, pool)


def ours_extend(loaded: LoadedModel, length: int, context: int) -> Callable[[], object]:
    """A new turn: ``length`` new tokens over ``context`` cached ones (re-run in place)."""
    model, bs = loaded.model, BLOCK_SIZE
    total = context + length
    num_blocks = -(-total // bs)
    pool = new_kv_pool(num_blocks, model.kv_shape(bs), model.dtype, "cpu")
    tokens = _prompts(1, total)[0].tolist()
    table = [list(range(num_blocks))]
    model.forward(
        ForwardBatch.from_lists([tokens[:context]], [0], [list(range(context))], table, bs), pool
    )
    step = ForwardBatch.from_lists(
        [tokens[context:]], [context], [list(range(context, total))], table, bs
    )
    return lambda: model.forward(step, pool)


def matrix_bytes(weight) -> int:
    """Bytes of one matrix as a step reads it: its layout's storage, scales included."""
    if isinstance(weight, NarrowWeight):
        scale = weight.scale.nbytes if weight.scale is not None else 0
        return weight.packed.nbytes + scale
    if isinstance(weight, TileWeight):
        return weight.packed.nbytes
    n, k = weight.shape
    return n * k * weight.element_size()


def decode_bytes(loaded: LoadedModel, batch: int, context: int, kv_dtype: str = "auto") -> int:
    """What one decode step must read from memory: every matrix once (the lm head
    included) and each sequence's K and V over its context in ``kv_dtype`` (an int8
    pool's scales included; norms and the B embedding rows are a rounding error)."""
    model = loaded.model
    matrices = [model._lm_head]
    for layer in model.weights.layers:
        matrices += [layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight]
    block = model.kv_shape(BLOCK_SIZE).block_bytes(kv_dtype_for(kv_dtype, model.dtype))
    kv = batch * (context + 1) * block // BLOCK_SIZE
    return sum(matrix_bytes(m) for m in matrices) + kv


BANDWIDTH_BYTES = 512 * 2**20


def read_memory() -> Callable[[], object]:
    """One pass over a buffer far larger than any cache: its time gives the read
    bandwidth under the same load as the steps it is interleaved with."""
    buffer = torch.ones(BANDWIDTH_BYTES // 4)
    return lambda: buffer.sum()


def hf_decode(hf, batch: int, context: int) -> Callable[[], object]:
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    token = torch.full((batch, 1), 7)
    position = torch.full((batch, 1), context)
    with torch.inference_mode():
        hf(_prompts(batch, context), cache=cache, use_cache=True)

    @torch.inference_mode()
    def step() -> None:
        hf(token, cache=cache, position_ids=position, use_cache=True)
        cache.crop(-1)  # drop the step's token: the same context length every time

    return step


def hf_prefill(hf, length: int) -> Callable[[], object]:
    tokens = _prompts(1, length)

    @torch.inference_mode()
    def run() -> None:
        hf(tokens, use_cache=False, logits_to_keep=1)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=None, help="bf16 or fp32 (default: by hardware)")
    parser.add_argument(
        "--model",
        default="smollm2",
        help="what load_model takes (default: the shipped SmolLM2-135M); with --weight-dtypes, "
        "a larger shape, e.g. random:qwen2.5-0.5b, puts a step's bytes past the CPU's last cache",
    )
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prefill", type=int, default=256, help="prompt tokens (0: skip)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); on a shared, busy CPU one thread avoids "
        "OpenMP threads spinning at barriers while descheduled",
    )
    parser.add_argument(
        "--thread-sweep",
        default="",
        help="comma-separated thread counts: time the prepacked decode at each, interleaved",
    )
    parser.add_argument(
        "--compare-backends",
        action="store_true",
        help="also time the prepacked decode and prefill on the torch kernel path "
        "(CHATSVC_KERNEL_BACKEND=torch) beside the default (native on CPU)",
    )
    parser.add_argument(
        "--compare-invariant",
        action="store_true",
        help="invariant kernels (the default) beside the fastest per step shape",
    )
    parser.add_argument("--extend", type=int, default=32, help="new tokens of the extend step")
    parser.add_argument(
        "--fastest-layout",
        default="",
        help="weight layout of the fastest model (e.g. onednn, the layout before invariance; "
        "default: the best available)",
    )
    parser.add_argument(
        "--weight-dtypes",
        default="",
        help="comma-separated weight dtypes of an fp32 model (fp32,bf16,int8; onednn: fp32 "
        "in oneDNN's layout): one model "
        "each, with the bytes a decode step reads and the bandwidth floor",
    )
    parser.add_argument(
        "--kv-dtypes",
        default="auto",
        help="with --weight-dtypes: comma-separated KV dtypes (auto,bf16,int8), each model "
        "timed over a pool of each",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.weight_dtypes:
        weight_dtypes_main(args)
        return
    if args.compare_invariant:
        invariant_main(args)
        return

    plain = load_model(args.model, dtype=args.dtype, prepack_weights=False)
    packed = load_model(args.model, dtype=args.dtype, prepack_weights=True)
    onednn = None
    if packed.model.weight_layout != "onednn" and can_prepack(
        packed.model.device, packed.model.dtype
    ):
        onednn = load_model(args.model, dtype=args.dtype, prepack_weights="onednn")
    dtype = plain.model.dtype
    hf = None
    if not args.skip_transformers and plain.path is None:
        print("random weights: no checkpoint for transformers to load; it is skipped")
    elif not args.skip_transformers:
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM.from_pretrained(str(plain.path), dtype=dtype, local_files_only=True)
        hf.eval()
    print(
        f"model {plain.name}, dtype {dtype}, threads {torch.get_num_threads()}, "
        f"prepacked = {packed.model.weight_layout} weights"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        fns = {
            "ours": ours_decode(plain, batch, args.context),
            "prepacked": ours_decode(packed, batch, args.context),
        }
        if onednn is not None:
            fns["onednn"] = ours_decode(onednn, batch, args.context)
        if args.compare_backends:
            fns["prepacked-torch-kernels"] = with_backend("torch", fns["prepacked"])
        for n in (int(t) for t in args.thread_sweep.split(",") if t):
            fns[f"threads={n}"] = with_threads(n, fns["prepacked"])
        if hf is not None:
            fns["transformers"] = hf_decode(hf, batch, args.context)
        ms = interleaved_medians(fns, args.steps)
        line = f"decode B={batch:<2} ctx={args.context}: " + " | ".join(
            f"{name} {t:6.1f} ms ({batch / t * 1e3:6.1f} tok/s)" for name, t in ms.items()
        )
        print(line, flush=True)
    if args.prefill:
        fns = {"prepacked": ours_prefill(packed, args.prefill)}
        if onednn is not None:
            fns["onednn"] = ours_prefill(onednn, args.prefill)
        if args.compare_backends:
            fns["prepacked-torch-kernels"] = with_backend("torch", fns["prepacked"])
        if hf is not None:
            fns["transformers"] = hf_prefill(hf, args.prefill)
        ms = interleaved_medians(fns, max(3, args.steps // 6))
        line = f"prefill {args.prefill} tokens: " + " | ".join(
            f"{name} {t:6.1f} ms ({args.prefill / t * 1e3:5.0f} tok/s)" for name, t in ms.items()
        )
        print(line, flush=True)


def invariant_main(args) -> None:
    """The default model with invariant kernels and with the fastest ones, interleaved."""
    fastest = args.fastest_layout or None
    models = {
        "invariant": load_model(args.model, dtype=args.dtype, invariant=True),
        "fastest": load_model(
            args.model, dtype=args.dtype, invariant=False, prepack_weights=fastest
        ),
    }
    first = models["invariant"]
    print(
        f"model {first.name}, dtype {first.model.dtype}, threads {torch.get_num_threads()}, "
        + ", ".join(f"{n}: {m.model.weight_layout} weights" for n, m in models.items())
    )

    def timed(label: str, fns: dict[str, Callable[[], object]], tokens: int, steps: int) -> None:
        ms = interleaved_medians(fns, steps)
        ratio = ms["invariant"] / ms["fastest"]
        print(
            f"{label}: "
            + " | ".join(f"{n} {t:7.1f} ms ({tokens / t * 1e3:6.0f} tok/s)" for n, t in ms.items())
            + f" | invariant/fastest {ratio:.3f}",
            flush=True,
        )

    for batch in (int(b) for b in args.batches.split(",")):
        fns = {n: ours_decode(m, batch, args.context) for n, m in models.items()}
        timed(f"decode B={batch} ctx={args.context}", fns, batch, args.steps)
    if args.extend:
        fns = {n: ours_extend(m, args.extend, args.context) for n, m in models.items()}
        timed(f"extend {args.extend} after {args.context}", fns, args.extend, args.steps)
    if args.prefill:
        fns = {n: ours_prefill(m, args.prefill) for n, m in models.items()}
        timed(f"prefill {args.prefill}", fns, args.prefill, max(5, args.steps // 3))


# Decode steps a round of ``--weight-dtypes`` runs back to back per model.
RUN = 8


class Variant(NamedTuple):
    """A model with weights in one dtype, timed over a KV pool of one dtype."""

    loaded: LoadedModel
    kv_dtype: str  # CHATSVC_KV_DTYPE's names
    short: str  # its name in the speed line


def weight_dtypes_main(args) -> None:
    """One model per weight dtype (over a pool of each KV dtype), decode steps beside the
    memory read that bounds them."""
    loads: dict[str, LoadedModel] = {}  # by weight dtype and layout
    models: dict[str, Variant] = {}  # ... and KV dtype
    kv_dtypes = args.kv_dtypes.split(",")
    for weight_dtype in args.weight_dtypes.split(","):
        if weight_dtype == "onednn":
            loaded = load_model(args.model, dtype=args.dtype, prepack_weights="onednn")
        else:
            loaded = load_model(args.model, dtype=args.dtype, weight_dtype=weight_dtype)
        name = f"{weight_dtype} ({loaded.model.weight_layout})"
        loads[name] = loaded
        for kv_dtype in kv_dtypes:
            kv = "" if kv_dtypes == ["auto"] else f" KV {kv_dtype}"
            models[name + kv] = Variant(loaded, kv_dtype, weight_dtype + kv)
    first = next(iter(loads.values()))
    print(
        f"model {first.name}, dtype {first.model.dtype}, threads {torch.get_num_threads()}; "
        f"read bandwidth: a sum over {BANDWIDTH_BYTES >> 20} MiB, interleaved with the steps"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        fns = {n: ours_decode(v.loaded, batch, args.context, v.kv_dtype) for n, v in models.items()}
        fns["memory read"] = read_memory()
        ms, first = interleaved_runs(fns, max(3, args.steps // RUN), RUN)
        first.pop("memory read")
        bandwidth = BANDWIDTH_BYTES / ms.pop("memory read") * 1e3  # bytes/s
        print(
            f"decode B={batch} ctx={args.context}, read bandwidth {bandwidth / 1e9:.1f} GB/s "
            f"(steps in runs of {RUN}; the first of a run apart):"
        )
        for name, t in ms.items():
            nbytes = decode_bytes(models[name].loaded, batch, args.context, models[name].kv_dtype)
            floor = nbytes / bandwidth * 1e3
            print(
                f"  {name:<30} {t:6.1f} ms ({batch / t * 1e3:6.1f} tok/s)  reads "
                f"{nbytes / 1e6:5.0f} MB = {nbytes / t / 1e6:4.1f} GB/s; "
                f"floor {floor:5.1f} ms, step/floor {t / floor:.2f}x; "
                f"first of a run {first[name]:5.1f} ms ({first[name] / floor:.2f}x)"
            )
        base_name, base = next(iter(ms.items()))
        speeds = ", ".join(f"{models[name].short} {base / t:.2f}x" for name, t in ms.items())
        print(f"  speed against {base_name}: {speeds}")
    if args.prefill:
        fns = {name: ours_prefill(loaded, args.prefill) for name, loaded in loads.items()}
        ms = interleaved_medians(fns, max(3, args.steps // 6))
        rates = (f"{n} {t:6.1f} ms ({args.prefill / t * 1e3:5.0f} tok/s)" for n, t in ms.items())
        print(f"prefill {args.prefill} tokens: " + " | ".join(rates))


if __name__ == "__main__":
    main()
