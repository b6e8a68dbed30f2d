"""Greedy answers with the prefix cache on and off: how many turns come out the same.

    .venv/bin/python -m bench.invariance [--dtype bf16] [--conversations 80]
        [--max-tokens 32] [--modes invariant,fastest] [--concurrency 16]

Runs ``bench/data/chat_turns.jsonl`` (80 two-turn chats, written for this project) through
``AsyncEngine`` twice per kernel mode, prefix cache on and off: every conversation's
first turn, then its second turn after its own first answer, ``--concurrency`` of them
in flight, greedy, ``--max-tokens`` each. With the cache on, each second turn finds its
first turn's blocks (and the system prompt's) cached; with it off, every prompt is
prefilled afresh in whatever batch it lands in. Prints, per kernel mode (``invariant``:
``CHATSVC_INVARIANT`` on, the default; ``fastest``: off), how many turns' answers are
token-identical between the two runs and the cached tokens of the cache-on run.
Figures, not assertions (tests/api/test_api_invariance.py asserts the property).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from cache import Namespace
from chatsvc.engine import AsyncEngine, EngineConfig
from chatsvc.protocol import GenerationRequest, SamplingParams

TURNS = Path(__file__).with_name("data") / "chat_turns.jsonl"
SYSTEM = "You are a helpful assistant. Answer briefly."


async def conversation(engine, index: int, turns: list[str], args, sem, out) -> None:
    fmt = engine.chat_format
    namespace = Namespace(tenant_salt=b"bench", label="bench")
    history = fmt.tokenize(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    end_turn = fmt.tokenize("<|im_end|>\n")
    for turn, text in enumerate(turns):
        prompt = history + fmt.tokenize(
            f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        )
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
        request = GenerationRequest(f"c{index}-t{turn}", prompt, params, namespace)
        output: list[int] = []
        async with sem:
            async for delta in engine.generate(request):
                output += delta.token_ids
                if delta.metrics is not None:
                    cached = delta.metrics.cached_prompt_tokens
        out[(index, turn)] = (output, cached)
        if output[-1] != end_turn[0]:
            output = [*output, end_turn[0]]
        history = prompt + output + end_turn[1:]


async def run(args, chats: list[list[str]], invariant: bool, cache: bool) -> dict:
    config = EngineConfig(
        dtype=args.dtype, invariant=invariant, enable_prefix_cache=cache, kv_disk_dir=None
    )
    engine = AsyncEngine(config)
    await engine.start()
    out: dict = {}
    sem = asyncio.Semaphore(args.concurrency)
    try:
        await asyncio.gather(
            *(conversation(engine, i, turns, args, sem, out) for i, turns in enumerate(chats))
        )
    finally:
        await engine.stop()
    return out


async def main_async(args) -> None:
    chats = [json.loads(line) for line in TURNS.read_text().splitlines() if line.strip()]
    chats = chats[: args.conversations]
    for mode in args.modes.split(","):
        invariant = mode == "invariant"
        on = await run(args, chats, invariant, cache=True)
        off = await run(args, chats, invariant, cache=False)
        same = sum(on[key][0] == off[key][0] for key in on)
        second = [key for key in on if key[1] == 1]
        same_second = sum(on[key][0] == off[key][0] for key in second)
        cached = sum(on[key][1] for key in on)
        print(
            f"{mode}: {same}/{len(on)} turns identical with the cache on and off "
            f"(second turns {same_second}/{len(second)}); cache-on run: {cached} cached "
            "prompt tokens",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=None, help="bf16 or fp32 (default: by hardware)")
    parser.add_argument("--conversations", type=int, default=80)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--modes", default="invariant,fastest")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
