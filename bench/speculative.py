"""Speculative decoding (issue 30): decode tokens/s and acceptance with it on and off.

    .venv/bin/python -m bench.speculative [--modes ngram] [--batches 1 8]
        [--max-tokens 96] [--rewrites 34] [--chats 32] [--dtype bf16]

Two workloads of second turns, each rendered with the chat template after a first
turn whose answer the model wrote itself (greedy, computed once before measuring):

- ``rewrite``: ``bench/data/rewrite_turns.jsonl``, pairs written for this benchmark: a
  first turn (often with a code block) and a second that asks to revise, shorten,
  translate, fix or repeat the answer or the code: where proposals from the
  conversation itself should hit;
- ``chat``: the default multi-turn workload's chats (``bench/data/chat_turns.jsonl``),
  whose second turns ask new questions;
- ``fresh``: those chats' first turns alone: no history to copy from, where proposals
  should rarely hit (and adaptive k has to back off).

Each engine (``off`` and each mode) has its own cache and sees every prompt once, in
groups of ``batch`` requests submitted together, the engines taking turns group by
group (the first engine of each group alternates), so drift on a shared machine
falls on both. Each workload and batch runs as a tenant of its own, so ``suffix``
proposes from the outputs of the measurement's earlier prompts only. A group's
decode time runs from the step where every request of it has its first token to its
end; its decode tokens are those produced in that time (the prefill is the same work
with speculation on or off and is left out). Prints, per workload and batch: decode
tokens/s off and on, the ratio (summed tokens over summed time, and the median of the
groups' ratios), the acceptance rate (accepted / proposed tokens) and whether every
greedy output equals the one without speculation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from cache import Namespace
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine
from chatsvc.engine.loader import load_model
from chatsvc.protocol import GenerationRequest, SamplingParams

DATA = Path(__file__).parent / "data"
NS = Namespace(tenant_salt=b"bench-speculative", label="bench")


def rewrite_pairs(limit: int) -> list[tuple[str, str]]:
    lines = (DATA / "rewrite_turns.jsonl").read_text().splitlines()
    return [(p["first"], p["second"]) for p in map(json.loads, lines[:limit])]


def chat_pairs(limit: int) -> list[tuple[str, str]]:
    lines = (DATA / "chat_turns.jsonl").read_text().splitlines()
    return [tuple(json.loads(line)[:2]) for line in lines[:limit]]


def run_group(engine: LLMEngine, requests: list[GenerationRequest]) -> tuple[dict, float, int]:
    """Run ``requests`` together; returns (outputs by id, decode seconds, decode tokens)."""
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    started = None  # when every request has its first token
    decode_tokens = 0
    while engine.has_unfinished_requests:
        deltas = engine.step()
        now = time.perf_counter()
        for out in deltas:
            if out.error is not None:
                raise out.error
            if started is not None:
                decode_tokens += len(out.delta.token_ids)
            outputs[out.request_id].extend(out.delta.token_ids)
        if started is None and all(outputs.values()):
            started = now
    return outputs, time.perf_counter() - started if started else 0.0, decode_tokens


def second_turns(engine: LLMEngine, pairs, max_tokens: int, batch: int) -> list[list[int]]:
    """The second turns' prompts: each first turn answered greedily by ``engine``."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompts = []
    for start in range(0, len(pairs), batch):
        group = pairs[start : start + batch]
        requests = [
            GenerationRequest(
                f"first-{start + i}",
                engine.chat_format.render([{"role": "user", "content": first}]),
                greedy,
                NS,
            )
            for i, (first, _) in enumerate(group)
        ]
        answers, _, _ = run_group(engine, requests)
        for i, (first, second) in enumerate(group):
            answer = engine.tokenizer.decode(
                answers[f"first-{start + i}"], skip_special_tokens=True
            )
            messages = [
                {"role": "user", "content": first},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": second},
            ]
            prompts.append(engine.chat_format.render(messages))
    return prompts


def measure(engines: dict, prompts: list[list[int]], max_tokens: int, batch: int, tag: str):
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    # A tenant per measurement: ``suffix`` never proposes an answer it gave to the same
    # prompt in an earlier measurement.
    ns = Namespace(tenant_salt=tag.encode(), label=tag)
    names = list(engines)
    seconds = {name: 0.0 for name in names}
    tokens = {name: 0 for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names[1:]}
    identical = {name: 0 for name in names[1:]}
    before = {n: e.speculator.stats() for n, e in engines.items() if e.speculator}
    for g, start in enumerate(range(0, len(prompts), batch)):
        group = prompts[start : start + batch]
        order = names if g % 2 == 0 else names[::-1]
        results = {}
        for name in order:
            requests = [
                GenerationRequest(f"{tag}-{name}-{start + i}", p, greedy, ns)
                for i, p in enumerate(group)
            ]
            outputs, spent, count = run_group(engines[name], requests)
            results[name] = [outputs[r.request_id] for r in requests]
            seconds[name] += spent
            tokens[name] += count
            results[name + "/rate"] = count / spent if spent else 0.0
        for name in names[1:]:
            pairs = zip(results[name], results["off"], strict=True)
            identical[name] += sum(a == b for a, b in pairs)
            if results["off/rate"]:
                ratios[name].append(results[name + "/rate"] / results["off/rate"])
    off_rate = tokens["off"] / seconds["off"]
    print(f"  {tag}: batch {batch}, {len(prompts)} prompts, max_tokens {max_tokens}")
    print(f"    off      {off_rate:8.1f} decode tokens/s")
    for name in names[1:]:
        rate = tokens[name] / seconds[name]
        after = engines[name].speculator.stats()
        proposed = after["proposed_tokens"] - before[name]["proposed_tokens"]
        accepted = after["accepted_tokens"] - before[name]["accepted_tokens"]
        acceptance = accepted / proposed if proposed else 0.0
        print(
            f"    {name:8} {rate:8.1f} decode tokens/s  x{rate / off_rate:.2f} "
            f"(median of groups x{statistics.median(ratios[name]):.2f})  "
            f"acceptance {acceptance:.2f} ({accepted}/{proposed})  "
            f"identical to off {identical[name]}/{len(prompts)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["ngram"], choices=["ngram", "suffix"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--first-tokens", type=int, default=128)
    parser.add_argument("--rewrites", type=int, default=34)
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--dtype", default=None, help="bf16 | fp32 (default: the engine's)")
    parser.add_argument("--max-k", type=int, default=EngineConfig.speculative_max_k)
    args = parser.parse_args()

    base = EngineConfig(dtype=args.dtype)
    loaded = load_model(base.model, base.dtype)
    engines = {}
    for mode in ["off", *args.modes]:
        config = EngineConfig(
            dtype=args.dtype, speculative=mode, speculative_max_k=args.max_k, warm_up_s=0
        )
        engines[mode] = LLMEngine(config, loaded=loaded)
    print(f"model {loaded.name} dtype {loaded.model.dtype}, max_k {args.max_k}")
    workloads = {
        "rewrite": rewrite_pairs(args.rewrites),
        "chat": chat_pairs(args.chats),
    }
    workloads["fresh"] = workloads["chat"]
    for tag, pairs in workloads.items():
        if not pairs:
            continue
        if tag == "fresh":
            render = engines["off"].chat_format.render
            prompts = [render([{"role": "user", "content": first}]) for first, _ in pairs]
        else:
            prompts = second_turns(engines["off"], pairs, args.first_tokens, 8)
        # Warm every engine's step shapes on one group before measuring.
        for engine in engines.values():
            warm = [
                GenerationRequest(f"warm-{tag}-{i}", p, SamplingParams(8, 0.0), NS)
                for i, p in enumerate(prompts[:2])
            ]
            run_group(engine, warm)
        for batch in args.batches:
            measure(engines, prompts, args.max_tokens, batch, f"{tag}-b{batch}")


if __name__ == "__main__":
    main()
