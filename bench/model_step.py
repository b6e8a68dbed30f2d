"""Decode-step time of our forward pass vs transformers' own, same model and input.

    .venv/bin/python -m bench.model_step [--dtype bf16|fp32] [--batches 1,8] [--steps 30]

Prints the median milliseconds of one decode step (B sequences, one token each,
after a prompt of --context tokens), for our LlamaModel over the paged KV pool and
for LlamaForCausalLM with its DynamicCache. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from chatsvc.engine.forward_batch import ForwardBatch
from chatsvc.engine.loader import load_model
from kernels.kv_layout import new_kv_pool


def _median_ms(fn, steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def bench_ours(loaded, batch: int, context: int, steps: int, block_size: int = 16) -> float:
    model = loaded.model
    blocks_per_seq = (context + steps + 8) // block_size + 1
    pool = new_kv_pool(batch * blocks_per_seq, model.kv_shape(block_size), model.dtype, "cpu")
    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (batch, context), generator=gen).tolist()

    def slots(b: int, start: int, end: int) -> list[int]:
        return [tables[b][p // block_size] * block_size + p % block_size for p in range(start, end)]

    prefill = ForwardBatch.from_lists(
        prompts, [0] * batch, [slots(b, 0, context) for b in range(batch)], tables, block_size
    )
    model.forward(prefill, pool)
    # Re-running the same decode position keeps the context length fixed across samples.
    step = ForwardBatch.from_lists(
        [[7]] * batch,
        [context] * batch,
        [slots(b, context, context + 1) for b in range(batch)],
        tables,
        block_size,
    )
    return _median_ms(lambda: model.forward(step, pool), steps)


def bench_transformers(path, dtype, batch: int, context: int, steps: int) -> float:
    from transformers import DynamicCache, LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (batch, context), generator=gen)
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        hf(prompts, cache=cache, use_cache=True)
        token = torch.full((batch, 1), 7)
        position = torch.full((batch, 1), context)

        def step() -> None:
            hf(token, cache=cache, position_ids=position, use_cache=True)
            cache.crop(-1)  # drop the step's token: same context length for every sample

        return _median_ms(step, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=None, help="bf16 or fp32 (default: by hardware)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); on a shared, busy CPU one thread avoids "
        "OpenMP threads spinning at barriers while descheduled",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model("smollm2", dtype=args.dtype, prepack_weights=False)
    packed = load_model("smollm2", dtype=args.dtype, prepack_weights=True)
    dtype = loaded.model.dtype
    print(f"model {loaded.name}, dtype {dtype}, threads {torch.get_num_threads()}")
    for batch in (int(b) for b in args.batches.split(",")):
        ours = bench_ours(loaded, batch, args.context, args.steps)
        ours_packed = bench_ours(packed, batch, args.context, args.steps)
        line = f"decode B={batch:<3} ctx={args.context}: ours {ours:7.2f} ms"
        line += f" | prepacked {ours_packed:7.2f} ms ({batch / ours_packed * 1e3:6.1f} tok/s)"
        if not args.skip_transformers:
            theirs = bench_transformers(loaded.path, dtype, batch, args.context, args.steps)
            line += f" | transformers {theirs:7.2f} ms ({theirs / ours_packed:4.1f}x slower)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
