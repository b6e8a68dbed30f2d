"""Paged-attention kernel benchmark (CUDA): ``python -m bench.kernels``.

Measures, on the current CUDA device:
- the device's copy bandwidth (a large device-to-device copy; bytes read +
  written / time),
- paged decode at batch 1/16/64/256 x context 1k/4k/16k: time, achieved K/V
  read bandwidth (bytes of K and V read / time) and its share of the copy
  bandwidth, and the time of torch's scaled_dot_product_attention on the same
  K/V laid out contiguously (the unpaged ideal),
- paged extend, 512-token chunks over 4k cached prefixes, against SDPA with a
  lower-right causal mask on contiguous K/V.

Times are medians of CUDA-event timings over ``--repeats`` runs after warm-up;
the kernels run with ``check_bounds=False`` (the hot path). Blocks are a random
permutation of the pool, as after a long-running server's churn. Configs that
would not fit in free device memory are listed as skipped. Without a CUDA
device the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable

import torch

DECODE_BATCHES = (1, 16, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 16384)
EXTEND_BATCHES = (1, 8, 32)
EXTEND_CHUNK = 512
EXTEND_PREFIX = 4096


def cuda_median_ms(fn: Callable[[], object], repeats: int, graphs: bool = False) -> float:
    """Median milliseconds of ``fn`` by CUDA events, after warm-up.

    With ``graphs``, ``fn`` is captured once into a CUDA graph and each repeat
    replays it, so the figure is GPU time without Python launch overhead (which
    otherwise dominates the small configs). A capture failure falls back to
    eager timing, with a note on stderr.
    """
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graphs:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        except RuntimeError as exc:
            print(f"CUDA graph capture failed, timing eagerly: {exc}", file=sys.stderr)
            torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(repeats: int) -> float:
    """Read + write bytes per second of a 1 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_median_ms(lambda: dst.copy_(src), repeats)
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def fits(nbytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.7 * free


class PagedSetup:
    """A one-layer pool holding ``lens`` contexts in shuffled blocks, plus contiguous K/V."""

    def __init__(self, batch: int, context: int, args: argparse.Namespace) -> None:
        from kernels.kv_layout import KVShape, layer_views, new_kv_pool

        bs, h_kv, d = args.block_size, args.kv_heads, args.head_dim
        blocks_per_seq = math.ceil(context / bs)
        num_blocks = batch * blocks_per_seq
        pool = new_kv_pool(num_blocks, KVShape(1, bs, h_kv, d), args.dtype, "cuda")
        pool.normal_()
        self.k_cache, self.v_cache = layer_views(pool, 0)
        order = torch.randperm(num_blocks, device="cuda").int()
        self.block_tables = order.view(batch, blocks_per_seq)
        self.context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        # The same tokens, contiguous: [B, H_kv, ctx, D].
        positions = torch.arange(context, device="cuda")
        ids = self.block_tables.long()[:, positions // bs]
        offsets = positions % bs
        self.k = self.k_cache[ids, offsets].transpose(1, 2).contiguous()
        self.v = self.v_cache[ids, offsets].transpose(1, 2).contiguous()
        self.pool = pool

    @staticmethod
    def bytes_needed(
        batch: int, context: int, args: argparse.Namespace, expanded: bool = False
    ) -> int:
        """Device bytes a config needs, with headroom; ``expanded``: + K/V at H_q heads."""
        itemsize = torch.empty((), dtype=args.dtype).element_size()
        kv = batch * context * 2 * args.kv_heads * args.head_dim * itemsize
        factor = 3  # pool + contiguous copy + gather temporaries
        if expanded:
            factor += args.q_heads // args.kv_heads
        return factor * kv


def bench_decode(args: argparse.Namespace, copy_gbs: float) -> list[str]:
    import torch.nn.functional as F

    import kernels

    rows = [
        "| batch | context | paged decode (µs) | K/V read (GB/s) | % of copy BW "
        "| contiguous SDPA (µs) | paged / contiguous |",
        "|---|---|---|---|---|---|---|",
    ]
    h_q, h_kv, d = args.q_heads, args.kv_heads, args.head_dim
    scale = 1 / math.sqrt(d)
    for context in DECODE_CONTEXTS:
        for batch in DECODE_BATCHES:
            if not fits(PagedSetup.bytes_needed(batch, context, args)):
                rows.append(f"| {batch} | {context} | skipped: does not fit | | | | |")
                continue
            setup = PagedSetup(batch, context, args)
            query = torch.randn(batch, h_q, d, dtype=args.dtype, device="cuda")
            paged_ms = cuda_median_ms(
                lambda s=setup, q=query: kernels.paged_decode_attention(
                    q,
                    s.k_cache,
                    s.v_cache,
                    s.block_tables,
                    s.context_lens,
                    scale,
                    check_bounds=False,
                ),
                args.repeats,
                args.graphs,
            )
            # GQA for the ideal: a KV head's query heads become SDPA's query axis.
            grouped = query.view(batch, h_kv, h_q // h_kv, d)
            ideal_ms = cuda_median_ms(
                lambda s=setup, q=grouped: F.scaled_dot_product_attention(q, s.k, s.v, scale=scale),
                args.repeats,
                args.graphs,
            )
            kv_bytes = setup.k.numel() * setup.k.element_size() * 2
            gbs = kv_bytes / (paged_ms * 1e-3) / 1e9
            rows.append(
                f"| {batch} | {context} | {paged_ms * 1e3:.1f} | {gbs:.0f} | "
                f"{100 * gbs / copy_gbs:.0f} % | {ideal_ms * 1e3:.1f} | "
                f"{paged_ms / ideal_ms:.2f} |"
            )
            del setup
            torch.cuda.empty_cache()
    return rows


def bench_extend(args: argparse.Namespace) -> list[str]:
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    import kernels

    rows = [
        "| batch | new tokens | cached prefix | paged extend (ms) | contiguous SDPA (ms) "
        "| paged / contiguous |",
        "|---|---|---|---|---|---|",
    ]
    h_q, h_kv, d = args.q_heads, args.kv_heads, args.head_dim
    scale = 1 / math.sqrt(d)
    context = EXTEND_PREFIX + EXTEND_CHUNK
    for batch in EXTEND_BATCHES:
        if not fits(PagedSetup.bytes_needed(batch, context, args, expanded=True)):
            rows.append(f"| {batch} | {EXTEND_CHUNK} | {EXTEND_PREFIX} | skipped | | |")
            continue
        setup = PagedSetup(batch, context, args)
        query = torch.randn(batch * EXTEND_CHUNK, h_q, d, dtype=args.dtype, device="cuda")
        starts = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * EXTEND_CHUNK
        paged_ms = cuda_median_ms(
            lambda s=setup, q=query, qs=starts: kernels.paged_extend_attention(
                q,
                s.k_cache,
                s.v_cache,
                s.block_tables,
                qs,
                s.context_lens,
                scale,
                check_bounds=False,
                max_query_len=EXTEND_CHUNK,
            ),
            args.repeats,
            args.graphs,
        )
        # The ideal gets K/V expanded to H_q heads up front (outside the timing):
        # a lower-right causal mask is not combinable with SDPA's GQA flag on
        # every torch version, and extend is compute-bound, so the extra K/V
        # reads barely matter.
        group = h_q // h_kv
        k = setup.k.repeat_interleave(group, dim=1)
        v = setup.v.repeat_interleave(group, dim=1)
        q = query.view(batch, EXTEND_CHUNK, h_q, d).transpose(1, 2)
        mask = causal_lower_right(EXTEND_CHUNK, context)
        ideal_ms = cuda_median_ms(
            lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=m, scale=scale
            ),
            args.repeats,
            args.graphs,
        )
        del k, v
        rows.append(
            f"| {batch} | {EXTEND_CHUNK} | {EXTEND_PREFIX} | {paged_ms:.3f} | {ideal_ms:.3f} | "
            f"{paged_ms / ideal_ms:.2f} |"
        )
        del setup
        torch.cuda.empty_cache()
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    parser.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32, 64))
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--eager",
        dest="graphs",
        action="store_false",
        help="time eager launches instead of CUDA-graph replays",
    )
    args = parser.parse_args(argv)
    if args.q_heads % args.kv_heads:
        parser.error("--q-heads must be a multiple of --kv-heads")
    args.dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device is present: nothing to measure (the kernels run on CUDA).")
        return 0
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth_gbs(args.repeats)
    print(f"## Paged attention kernels on {name}\n")
    print(
        f"H_q {args.q_heads}, H_kv {args.kv_heads}, head_dim {args.head_dim}, "
        f"block_size {args.block_size}, {str(args.dtype).removeprefix('torch.')}; "
        f"medians of {args.repeats} {'CUDA-graph replays' if args.graphs else 'eager runs'}. "
        "Device copy bandwidth (read + write): "
        f"{copy_gbs:.0f} GB/s.\n"
    )
    print("### Decode\n")
    print("\n".join(bench_decode(args, copy_gbs)))
    print("\n### Extend\n")
    print("\n".join(bench_extend(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
