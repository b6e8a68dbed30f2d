"""Engine benchmark: concurrent multi-turn conversations with a shared system prompt.

    .venv/bin/python -m bench.engine [--conversations 16] [--turns 6] [--max-tokens 128]
        [--system-repeat 15] [--max-defer-steps 4] [--think-time 0]

Defaults are a typical chat: a ~500-token shared system prompt and answers of up to
128 tokens, so by turn 3 a prompt holds ~1,000 tokens of history. With no think time
(the default) each conversation sends its next turn as soon as its answer is complete;
``--think-time 1`` pauses as bench.multiturn's users do.

Runs the workload through AsyncEngine twice, prefix cache on and off, and prints
per-turn TTFT (median over conversations), output tokens/s, and the prefix hit
rate against the ideal: the prompt tokens an earlier request had already
computed, at block granularity, never counting the last prompt token. A last
TTFT row pools turns 3 and later of all conversations into one median.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from cache import Namespace
from chatsvc.engine import AsyncEngine, EngineConfig
from chatsvc.protocol import GenerationRequest, SamplingParams

# One sentence of the shared system prompt (~33 tokens); --system-repeat sets its length.
SYSTEM_SENTENCE = (
    "You are a concise assistant for a travel company. Answer in one or two sentences, "
    "stay friendly, never invent prices, and suggest one concrete next step. "
)
TOPICS = ["Lisbon", "Kyoto", "Oslo", "Lima", "Cairo", "Hanoi", "Quebec", "Perth"]


class IdealTracker:
    """Block-aligned prefixes some earlier request computed (hashes of token tuples)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.prefixes: set[int] = set()

    def ideal(self, prompt: list[int]) -> int:
        best = 0
        for end in range(self.block_size, len(prompt), self.block_size):
            if hash(tuple(prompt[:end])) not in self.prefixes:
                break
            best = end
        return best

    def add(self, computed: list[int]) -> None:
        for end in range(self.block_size, len(computed) + 1, self.block_size):
            self.prefixes.add(hash(tuple(computed[:end])))


async def conversation(engine, conv: int, args, tracker, rows) -> None:
    turns, max_tokens = args.turns, args.max_tokens
    fmt = engine.chat_format
    system_text = SYSTEM_SENTENCE * args.system_repeat
    system = fmt.tokenize(f"<|im_start|>system\n{system_text}<|im_end|>\n")
    namespace = Namespace(tenant_salt=b"bench", shared_prefix_len=len(system), label="bench")
    history = list(system)
    end_turn = fmt.tokenize("<|im_end|>\n")
    # The user reads the answer and types the next question: the same pauses in the
    # cache-on and cache-off runs (seeded per conversation).
    pauses = random.Random(conv)
    for turn in range(turns):
        if turn and args.think_time:
            await asyncio.sleep(pauses.uniform(0, args.think_time))
        question = f"Tell me fact {turn + 1} about {TOPICS[conv % len(TOPICS)]} (trip {conv})."
        prompt = history + fmt.tokenize(
            f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        )
        ideal = tracker.ideal(prompt)
        # Ideal: any request submitted earlier counts as computed (an upper bound; a
        # request admitted in the same step as its twin cannot hit it).
        tracker.add(prompt)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        request = GenerationRequest(f"c{conv}-t{turn}", prompt, params, namespace)
        start = time.perf_counter()
        first = None
        output: list[int] = []
        async for delta in engine.generate(request):
            if first is None:
                first = time.perf_counter()
            output += delta.token_ids
            if delta.metrics is not None:
                metrics = delta.metrics
        tracker.add(prompt + output[:-1])
        rows.append(
            (turn, first - start, len(output), metrics.cached_prompt_tokens, ideal, len(prompt))
        )
        if output[-1] != end_turn[0]:
            output.append(end_turn[0])
        history = prompt + output + end_turn[1:]


async def run(args, enable_prefix_cache: bool) -> dict:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        num_gpu_blocks=args.blocks,
        enable_prefix_cache=enable_prefix_cache,
        max_num_batched_tokens=args.batch_tokens,
        max_defer_steps=args.max_defer_steps,
    )
    # The engine loads the model on its own thread: a model loaded here would leave
    # this thread an OpenMP team too, and two teams on 2 cores slow every step.
    engine = AsyncEngine(config)
    await engine.start()
    name, dtype = engine.model_name, engine.info.dtype
    tracker = IdealTracker(config.block_size)
    rows: list = []
    start = time.perf_counter()
    try:
        await asyncio.gather(
            *(conversation(engine, c, args, tracker, rows) for c in range(args.conversations))
        )
    finally:
        await engine.stop()
    elapsed = time.perf_counter() - start
    per_turn = {t: statistics.median(r[1] for r in rows if r[0] == t) for t in range(args.turns)}
    later = [r[1] for r in rows if r[0] >= 2]
    return {
        "ttft": per_turn,
        # All conversations' turns 3.. in one median (as bench.multiturn reports TTFT):
        # a turn's own median over 16 conversations swings with how many of them happen
        # to send that turn in the same step.
        "ttft_later": statistics.median(later) if later else float("nan"),
        "tokens_per_s": sum(r[2] for r in rows) / elapsed,
        "hit": sum(r[3] for r in rows),
        "ideal": sum(r[4] for r in rows),
        "prompt": sum(r[5] for r in rows),
        "elapsed": elapsed,
        "model": f"{name} dtype={dtype}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--system-repeat",
        type=int,
        default=15,
        help="sentences in the shared system prompt (~33 tokens each)",
    )
    parser.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="a user pauses uniform 0..S seconds before each later turn (0: no pause)",
    )
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--batch-tokens", type=int, default=512)
    parser.add_argument(
        "--max-defer-steps",
        type=int,
        default=EngineConfig.max_defer_steps,
        help="steps a request may wait for another's prefill of its prefix (0: never)",
    )
    args = parser.parse_args()
    results = {on: asyncio.run(run(args, on)) for on in (True, False)}
    on, off = results[True], results[False]
    print(
        f"model={on['model']} conversations={args.conversations} "
        f"turns={args.turns} max_tokens={args.max_tokens} max_defer_steps={args.max_defer_steps} "
        f"system_repeat={args.system_repeat} think_time={args.think_time}"
    )
    print("turn  ttft_cache_ms  ttft_nocache_ms  speedup")
    for t in range(args.turns):
        a, b = on["ttft"][t] * 1e3, off["ttft"][t] * 1e3
        print(f"{t + 1:>4}  {a:>13.1f}  {b:>15.1f}  {b / a:>6.1f}x")
    if args.turns >= 3:
        a, b = on["ttft_later"] * 1e3, off["ttft_later"] * 1e3
        print(f"{'3+':>4}  {a:>13.1f}  {b:>15.1f}  {b / a:>6.1f}x   (turns 3.. pooled)")
    for name, r in (("cache on", on), ("cache off", off)):
        print(
            f"{name:>9}: {r['tokens_per_s']:.1f} output tok/s, wall {r['elapsed']:.1f} s, "
            f"hit {r['hit']}/{r['prompt']} prompt tokens"
        )
    ratio = on["hit"] / on["ideal"] if on["ideal"] else 1.0
    print(f"hit rate vs ideal: {on['hit']}/{on['ideal']} = {ratio:.1%}")


if __name__ == "__main__":
    main()
