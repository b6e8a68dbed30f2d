"""Shared host: the same chat workload on a quiet machine and beside a busy neighbour.

    .venv/bin/python -m bench.shared_host [--conversations 8] [--turns 4] [--in-flight 4]
        [--max-tokens 64] [--rounds 2] [--threads N] [--dtype fp32]

Real deployments share their cores (a laptop, a container on a busy node, a CI
runner). One engine (AsyncEngine, the default model, greedy) serves
``--conversations`` multi-turn conversations, ``--in-flight`` at a time, each turn
sent once the previous answer ended; the workload runs alternately on the quiet
machine and beside the *neighbour*: ``nice -n 19`` on a Python busy loop (one
process, the lowest priority, one core's worth of demand), started in a session of
its own as a process from another terminal or container is: with the kernel's
autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) sessions share
the CPU fairly and nice counts only inside one, so it takes up to a whole core
(``--neighbour-session same`` runs it in this one, where nice 19 leaves it little).
``--rounds`` of each,
interleaved quiet / busy, with fresh conversations every run (so no run's cache
helps another). Prints per run and as medians: TTFT p50 of turns 2.. (the turns a
returning user waits for), decode tokens/s (output tokens after the first of each
answer over the time they took, per answer, median), and wall time; then the
busy/quiet ratios (issue 27's target: at most 2.5x; the CPU lost is half).

Thread counts and OpenMP's waiting are process-wide, set before torch loads:
compare policies by running this script once per setting (``--threads``, which
fixes the count and so turns the engine's thread governor off, ``OMP_WAIT_POLICY``,
``GOMP_SPINCOUNT`` in the environment). Figures, not checks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from cache import Namespace
from chatsvc.engine import AsyncEngine, EngineConfig
from chatsvc.protocol import GenerationRequest, SamplingParams

SYSTEM = "You are a concise assistant for a travel company. Answer in a few sentences. " * 4
TOPICS = ["Lisbon", "Kyoto", "Oslo", "Lima", "Cairo", "Hanoi", "Quebec", "Perth"]
NEIGHBOUR = ["nice", "-n", "19", sys.executable, "-c", "while 'shared-host neighbour': pass"]


@dataclass
class Run:
    ttfts: list[float] = field(default_factory=list)  # turns 2..
    decode_rates: list[float] = field(default_factory=list)  # tokens/s after the first
    wall_s: float = 0.0


async def conversation(engine, name: str, turns: int, max_tokens: int, run: Run) -> None:
    fmt = engine.chat_format
    system = fmt.tokenize(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    history = list(system)
    namespace = Namespace(tenant_salt=b"shared-host", shared_prefix_len=len(system), label="b")
    for turn in range(turns):
        topic = TOPICS[hash(name) % len(TOPICS)]
        question = f"Tell me fact {turn + 1} about {topic} ({name})."
        prompt = history + fmt.tokenize(
            f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        )
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = GenerationRequest(f"{name}-t{turn}", prompt, params, namespace)
        start = time.perf_counter()
        first = last = None
        output: list[int] = []
        async for delta in engine.generate(request):
            last = time.perf_counter()
            if first is None and delta.token_ids:
                first = last
            output += delta.token_ids
        if turn:
            run.ttfts.append(first - start)
        if len(output) > 1 and last > first:
            run.decode_rates.append((len(output) - 1) / (last - first))
        history = prompt + output + fmt.tokenize("<|im_end|>\n")


async def one_run(engine, tag: str, args) -> Run:
    run = Run()
    slots = asyncio.Semaphore(args.in_flight)

    async def held(i: int) -> None:
        async with slots:
            await conversation(engine, f"{tag}-{i}", args.turns, args.max_tokens, run)

    start = time.perf_counter()
    await asyncio.gather(*(held(i) for i in range(args.conversations)))
    run.wall_s = time.perf_counter() - start
    return run


async def main_async(args) -> None:
    config = EngineConfig(num_threads=args.threads, dtype=args.dtype, max_num_batched_tokens=512)
    engine = AsyncEngine(config)
    await engine.start()
    runs: dict[str, list[Run]] = {"quiet": [], "busy": []}
    try:
        await one_run(engine, "warm", args)  # first-call costs out of the way
        for number in range(args.rounds):
            for kind in ("quiet", "busy") if number % 2 == 0 else ("busy", "quiet"):
                neighbour = None
                if kind == "busy":
                    own = args.neighbour_session == "new"
                    neighbour = subprocess.Popen(NEIGHBOUR, start_new_session=own)
                try:
                    if neighbour:
                        time.sleep(0.5)  # let it start spinning
                    run = await one_run(engine, f"{kind}{number}", args)
                finally:
                    if neighbour:
                        neighbour.kill()
                        neighbour.wait()
                runs[kind].append(run)
                print(
                    f"round {number + 1} {kind:<5}  ttft_p50_ms "
                    f"{statistics.median(run.ttfts) * 1e3:8.1f}  decode_tok_s "
                    f"{statistics.median(run.decode_rates):7.1f}  wall_s {run.wall_s:6.1f}",
                    flush=True,
                )
    finally:
        await engine.stop()
    print(
        f"model={engine.model_name} dtype={engine.info.dtype} threads={args.threads or 'default'} "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')} "
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')} conversations="
        f"{args.conversations} turns={args.turns} in_flight={args.in_flight} "
        f"max_tokens={args.max_tokens} rounds={args.rounds} "
        f"neighbour_session={args.neighbour_session}"
    )
    medians = {}
    for kind, kind_runs in runs.items():
        medians[kind] = (
            statistics.median(statistics.median(r.ttfts) for r in kind_runs),
            statistics.median(statistics.median(r.decode_rates) for r in kind_runs),
            statistics.median(r.wall_s for r in kind_runs),
        )
        ttft, rate, wall = medians[kind]
        print(
            f"median {kind:<5}  ttft_p50_ms {ttft * 1e3:8.1f}  decode_tok_s {rate:7.1f}  "
            f"wall_s {wall:6.1f}"
        )
    (qt, qr, qw), (bt, br, bw) = medians["quiet"], medians["busy"]
    print(
        f"busy/quiet: ttft {bt / qt:.2f}x, decode {qr / br:.2f}x slower, wall {bw / qw:.2f}x "
        "(target <= 2.5x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="default: the engine's")
    parser.add_argument("--dtype", default=None, help="default: the machine's (bf16 or fp32)")
    parser.add_argument("--neighbour-session", choices=("new", "same"), default="new")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
