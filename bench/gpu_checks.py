"""The checks that need a CUDA device, in one run (``bench/gpu_check.sh`` calls this).

    .venv/bin/python -m bench.gpu_checks [--device cuda] [--skip kernels,...]

1. kernels      every Triton kernel against its torch reference on the device
                (decode with and without split contexts, extend over cached
                prefixes, KV write, block copy), fp32 and bf16
2. conversation a greedy fp32 conversation of the real model on the device,
                token for token against the CPU engine
3. host swaps   a device pool too small for the conversations, with a pinned host
                tier: blocks swap out and back (on the swap stream) and the
                greedy tokens equal a pool that holds everything
4. disk tier    a restart on the device: the warm-up's disk load (a scratch block
                through the pinned staging buffer and back into the pool), the
                preload (the files read into pinned memory while idle), and the
                next turn's blocks from it with the same greedy tokens
5. invariance   a token's bits independent of its step (``bench.gpu_invariance``:
                span attention, matmul and RMSNorm rows, the model's logits and K/V
                over chunkings and batch companions), fp32 and bf16, as a table

Each check prints one line, PASS or FAIL with the reason; the exit status is
the number of failures. ``--device cpu`` runs 2-5 on the CPU (1 needs CUDA),
which is how the suite keeps this script working without a GPU (5 then checks the
torch backend's spans and the fp32 model).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import traceback

import torch

from bench.gpu_invariance import check_invariance
from cache import Namespace
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine
from chatsvc.engine.loader import load_model
from chatsvc.protocol import GenerationRequest, SamplingParams
from kernels.kv_layout import KVShape, layer_views, new_kv_pool

NS = Namespace(tenant_salt=b"gpu-check", label="gpu")
QUESTIONS = ["What is the capital of France?", "Name two rivers there.", "Which is longer?"]
CHECKS = ("kernels", "conversation", "host_swaps", "disk_tier", "invariance")


# -- 1. kernels ----------------------------------------------------------------------


def _paged_case(lens, block_size, kv_heads, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 3
    pool = new_kv_pool(num_blocks, KVShape(2, block_size, kv_heads, head_dim), dtype, "cpu")
    pool.copy_(torch.randn(pool.shape, generator=gen).to(dtype))
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(per_seq) + 1), -1, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(per_seq):
        tables[b, :nb] = order[used : used + nb].int()
        used += nb
    pool = pool.to(device)
    k_cache, v_cache = layer_views(pool, 1)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    return pool, k_cache, v_cache, tables.to(device), lens_t


def _close(out, ref, dtype, what):
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    err = (out.float() - ref.float()).abs().max().item()
    if not err <= tol * max(1.0, ref.float().abs().max().item()):
        raise AssertionError(f"{what} {dtype}: max error {err:.3g} over tolerance {tol}")


def check_kernels(device: str) -> str:
    import kernels

    if torch.device(device).type != "cuda":
        return "SKIP (the Triton kernels run on CUDA here; CPU runs use the interpreter tests)"
    cases = 0
    for dtype in (torch.float32, torch.bfloat16):
        for group, head_dim, bs, lens, partition in [
            (1, 64, 16, [1, 16, 37], None),
            (4, 128, 16, [700, 33], 64),
            (4, 64, 64, [4100, 5], 256),
        ]:
            pool, k, v, tables, lens_t = _paged_case(lens, bs, 2, head_dim, dtype, device)
            query = torch.randn(len(lens), 2 * group, head_dim, device=device).to(dtype)
            args = (query, k, v, tables, lens_t, 1 / math.sqrt(head_dim))
            ref = kernels.paged_decode_attention(*args, backend="torch")
            out = kernels.paged_decode_attention(*args, backend="triton", partition_size=partition)
            _close(out, ref, dtype, f"decode {lens}")
            cases += 1
        for group, head_dim, bs, lens, q_lens in [
            (1, 64, 16, [40, 16], [40, 1]),
            (4, 128, 16, [1100, 64], [512, 0]),
        ]:
            pool, k, v, tables, lens_t = _paged_case(lens, bs, 2, head_dim, dtype, device)
            total = sum(q_lens)
            query = torch.randn(total, 2 * group, head_dim, device=device).to(dtype)
            starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
            args = (query, k, v, tables, starts.to(device), lens_t, 1 / math.sqrt(head_dim))
            ref = kernels.paged_extend_attention(*args, backend="torch")
            out = kernels.paged_extend_attention(*args, backend="triton")
            _close(out, ref, dtype, f"extend {lens}/{q_lens}")
            cases += 1
        pool_t, k_t, v_t, tables, _ = _paged_case([20, 9], 16, 2, 64, dtype, device)
        pool_r = pool_t.clone()
        k_r, v_r = layer_views(pool_r, 1)
        slots = torch.tensor(
            [tables[0, 1].item() * 16 + 3, -1, tables[1, 0].item() * 16], device=device
        )
        key = torch.randn(3, 2, 64, device=device).to(dtype)
        value = torch.randn(3, 2, 64, device=device).to(dtype)
        kernels.write_kv(k_r, v_r, key, value, slots, backend="torch")
        kernels.write_kv(k_t, v_t, key, value, slots, backend="triton")
        if not torch.equal(pool_t, pool_r):
            raise AssertionError(f"write_kv {dtype}: pools differ")
        pairs = torch.tensor([[0, 3], [1, 4]], device=device)
        expected = pool_t.clone()
        kernels.copy_blocks(expected, expected, pairs, backend="torch")
        kernels.copy_blocks(pool_t, pool_t, pairs, backend="triton")
        if not torch.equal(pool_t, expected):
            raise AssertionError(f"copy_blocks {dtype}: pools differ")
        cases += 2
    torch.cuda.synchronize()
    return f"PASS ({cases} cases)"


# -- 2-4. the engine ----------------------------------------------------------------------


def _run(engine: LLMEngine, request_id: str, tokens: list[int], max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engine.add_request(GenerationRequest(request_id, tokens, params, NS))
    out, metrics = [], None
    while engine.has_unfinished_requests:
        for step in engine.step():
            if step.error is not None:
                raise step.error
            out += step.delta.token_ids
            if step.delta.metrics is not None:
                metrics = step.delta.metrics
    return out, metrics


def conversation(
    engine: LLMEngine, turns: int, max_tokens: int, history=None, start=0, user: str = ""
):
    """Greedy turns (``user`` makes the questions another user's); returns
    (outputs, metrics, history)."""
    fmt = engine.chat_format
    end = fmt.tokenize("<|im_end|>\n")
    history = list(history or [])
    outputs, metrics = [], []
    for turn in range(start, start + turns):
        text = f"<|im_start|>user\n{user}{QUESTIONS[turn % len(QUESTIONS)]}<|im_end|>\n"
        tokens = history + fmt.tokenize(text + "<|im_start|>assistant\n")
        out, m = _run(engine, f"turn{turn}", tokens, max_tokens)
        outputs.append(out)
        metrics.append(m)
        if out[-1] != end[0]:
            out = out + end[:1]
        history = tokens + out + end[1:]
    return outputs, metrics, history


class Models:
    """The fp32 model on the device and on the CPU, each loaded once."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._loaded: dict[str, object] = {}

    def on(self, device: str):
        if device not in self._loaded:
            self._loaded[device] = load_model("smollm2", dtype="fp32", device=device)
        return self._loaded[device]

    def engine(self, device: str, **overrides) -> LLMEngine:
        config = dict(dtype="fp32", device=device, num_gpu_blocks=256, num_host_blocks=0)
        config.update(overrides)
        return LLMEngine(EngineConfig(**config), loaded=self.on(device))


def check_conversation(models: Models, args) -> str:
    on_device, _, _ = conversation(models.engine(models.device), args.turns, args.max_tokens)
    on_cpu, _, _ = conversation(models.engine("cpu"), args.turns, args.max_tokens)
    for turn, (a, b) in enumerate(zip(on_device, on_cpu, strict=True)):
        if a != b:
            first = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            raise AssertionError(f"turn {turn + 1} differs from token {first}: {a} vs {b}")
    return f"PASS ({args.turns} turns of {args.max_tokens} tokens equal the CPU engine's)"


def check_host_swaps(models: Models, args) -> str:
    turns, max_tokens = args.turns, args.max_tokens
    expected, _, full = conversation(models.engine(models.device), turns + 1, max_tokens)
    # A pool that holds one conversation and little more: other users push its
    # blocks to the host tier, and its next turn brings them back.
    pool = -(-(len(full) + max_tokens) // 16) + 1
    small = models.engine(models.device, num_gpu_blocks=pool, num_host_blocks=4 * pool)
    got, _, history = conversation(small, turns, max_tokens)
    for other in range(pool // 2 + 1):
        user = f"I am traveller number {other} and I plan a long trip through Europe. "
        conversation(small, 1, max_tokens, user=user)
    again, _, _ = conversation(small, 1, max_tokens, history=history, start=turns)
    got += again
    stats = small.cache_stats()
    small.check_integrity()
    if got != expected:
        raise AssertionError("greedy tokens changed with host swaps")
    if not stats["swapped_out_blocks"] or not stats["swapped_in_blocks"]:
        swaps = f"{stats['swapped_out_blocks']} out, {stats['swapped_in_blocks']} in"
        raise AssertionError(f"no swaps happened: {swaps}")
    return (
        f"PASS (greedy equal; {stats['swapped_out_blocks']} blocks swapped out, "
        f"{stats['swapped_in_blocks']} in)"
    )


def check_disk_tier(models: Models, args) -> str:
    with tempfile.TemporaryDirectory(prefix="gpu-kv-") as kv_dir:
        expected, _, _ = conversation(
            models.engine(models.device, enable_prefix_cache=False), args.turns + 1, args.max_tokens
        )
        first = models.engine(models.device, kv_disk_dir=kv_dir)
        got, _, history = conversation(first, args.turns, args.max_tokens)
        first.close()
        second = models.engine(models.device, kv_disk_dir=kv_dir)
        probe = second.disk_tier.warm_up_load(60.0)
        planned = second.start_preload()
        deadline = time.monotonic() + 60
        while second.has_unapplied_io and time.monotonic() < deadline:
            second.apply_io(0.05)
        last, metrics, _ = conversation(
            second, 1, args.max_tokens, history=history, start=args.turns
        )
        disk = metrics[0].cached_tokens_by_tier["disk"]
        preload = second.cache_stats()["disk"]["preload"]
        block_size = second.config.block_size
        second.check_integrity()
        second.close()
    if got + last != expected:
        raise AssertionError("greedy tokens after the restart differ from the uncached run")
    if disk == 0:
        raise AssertionError("the turn after the restart had no disk hit")
    if probe != "ok":
        raise AssertionError(f"the warm-up's disk load failed: {probe}")
    from_preload = preload["used_blocks"] * block_size
    if not planned or preload["read_blocks"] != planned or from_preload != disk:
        raise AssertionError(f"the turn's disk blocks did not all come from the preload: {preload}")
    return (
        f"PASS (warm-up disk load ok; preload {planned} blocks; turn after the restart: "
        f"{disk} tokens from disk, all preloaded, greedy equal)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--skip", default="", help=f"comma-separated, of {','.join(CHECKS)}")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("No CUDA device is present: nothing to check.")
        return 0
    skip = {s for s in args.skip.split(",") if s}
    models = Models(args.device)
    runs = {
        "kernels": lambda: check_kernels(args.device),
        "conversation": lambda: check_conversation(models, args),
        "host_swaps": lambda: check_host_swaps(models, args),
        "disk_tier": lambda: check_disk_tier(models, args),
        "invariance": lambda: check_invariance(args.device, models.on(args.device)),
    }
    failures = 0
    for name in CHECKS:
        if name in skip:
            continue
        start = time.perf_counter()
        try:
            line = runs[name]()
        except Exception as exc:  # noqa: BLE001 - reported, then the next check runs
            traceback.print_exc()
            line = f"FAIL: {exc}"
            failures += 1
        print(f"{name:<13} {line}  [{time.perf_counter() - start:.0f} s]", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
