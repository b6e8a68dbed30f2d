"""Cost of the KV-cache bookkeeping alone (no model, no tensors).

    python -m bench.cache_ops

Prints the median of repeated runs for:
- match + allocate of a 2,000-token prompt whose first 90 % is cached,
- one decode step: append_slots for 256 running sequences,
- free of 256 finished sequences.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cache import KVCacheManager, Namespace

BLOCK_SIZE = 16
NS = Namespace(b"bench-salt", label="bench")


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def bench_match_allocate(repeats: int) -> float:
    mgr = KVCacheManager(4096, BLOCK_SIZE)
    prompt = list(range(2000))
    cached = prompt[:1800]
    mgr.allocate("warm", cached + [1], NS)
    mgr.mark_computed("warm", len(cached) + 1)
    mgr.free("warm")
    samples = []
    for i in range(repeats):
        start = time.perf_counter()
        result = mgr.allocate(i, prompt, NS)
        samples.append(time.perf_counter() - start)
        assert result.num_cached_tokens == 1792, result.num_cached_tokens
        mgr.free(i)
    return _median_us(samples)


def _running_batch(num_seqs: int, prompt_len: int) -> KVCacheManager:
    mgr = KVCacheManager(num_seqs * (prompt_len // BLOCK_SIZE + 40), BLOCK_SIZE)
    for seq in range(num_seqs):
        tokens = [seq % 50_000] + list(range(prompt_len - 1))
        mgr.allocate(seq, tokens, NS)
        mgr.mark_computed(seq, prompt_len)
    return mgr


def bench_decode_step(num_seqs: int, steps: int) -> tuple[float, float]:
    """Median and worst step over ``steps`` decode steps (every 16th crosses a block)."""
    mgr = _running_batch(num_seqs, 300)
    seq_ids = list(range(num_seqs))
    token = [42]
    append = mgr.append_slots
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        for seq in seq_ids:
            append(seq, token)
        samples.append(time.perf_counter() - start)
    return _median_us(samples), max(samples) * 1e6


def bench_decode_step_with_index(num_seqs: int, steps: int) -> float:
    """append_slots plus mark_computed (which indexes each newly full block)."""
    mgr = _running_batch(num_seqs, 300)
    seq_ids = list(range(num_seqs))
    token = [42]
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        for seq in seq_ids:
            mgr.append_slots(seq, token)
        for seq in seq_ids:
            mgr.mark_computed(seq, mgr.num_tokens(seq))
        samples.append(time.perf_counter() - start)
    return _median_us(samples)


def bench_free(num_seqs: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        mgr = _running_batch(num_seqs, 300)
        start = time.perf_counter()
        for seq in range(num_seqs):
            mgr.free(seq)
        samples.append(time.perf_counter() - start)
    return _median_us(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--seqs", type=int, default=256)
    args = parser.parse_args()
    print(f"block_size={BLOCK_SIZE}, median of {args.repeats} runs")
    allocate_us = bench_match_allocate(args.repeats)
    print(f"match+allocate 2000-token prompt, 90% cached: {allocate_us:9.1f} us")
    median, worst = bench_decode_step(args.seqs, args.repeats * 4)
    print(f"decode step append_slots x {args.seqs}:        {median:9.1f} us (worst {worst:.1f})")
    indexed = bench_decode_step_with_index(args.seqs, args.repeats * 4)
    print(f"decode step append+mark_computed x {args.seqs}: {indexed:9.1f} us")
    print(f"free {args.seqs} finished sequences:            {bench_free(args.seqs, 10):9.1f} us")


if __name__ == "__main__":
    main()
