"""What the default sampling settings do to a first turn: samples before and after.

    python -m bench.compat.default_samples
    python -m bench.compat.default_samples --question "Capital of France?" --seeds 4

Runs the engine directly (no server): each seed once at temperature 1.0 / top-p 1.0
(the neutral values, the old default) and once with the served model's defaults
(``engine.sampling_defaults``), all in one batch, and prints a markdown table.
"""

from __future__ import annotations

import argparse

from cache import Namespace
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine
from chatsvc.protocol import GenerationRequest, SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--question", default="Capital of France?")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=args.model, num_gpu_blocks=256))
    defaults = engine.sampling_defaults
    settings = {
        "temperature 1.0, top-p 1.0": dict(temperature=1.0, top_p=1.0),
        f"defaults ({defaults.source}): temperature {defaults.temperature:g}, "
        f"top-p {defaults.top_p:g}": dict(
            temperature=defaults.temperature,
            top_p=defaults.top_p,
            top_k=defaults.top_k,
            min_p=defaults.min_p,
            repetition_penalty=defaults.repetition_penalty,
        ),
    }
    prompt = engine.chat_format.render([{"role": "user", "content": args.question}])
    namespace = Namespace(tenant_salt=b"samples", label="samples")
    texts: dict[str, str] = {}
    for name, fields in settings.items():
        for seed in range(args.seeds):
            params = SamplingParams(max_tokens=args.max_tokens, seed=seed, **fields)
            engine.add_request(GenerationRequest(f"{name}|{seed}", prompt, params, namespace))
            texts[f"{name}|{seed}"] = ""
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.error is not None:
                raise out.error
            texts[out.request_id] += out.delta.text
    print(f"{args.question!r}, {args.max_tokens} tokens, {engine.model_name}\n")
    print("| setting | " + " | ".join(f"seed {s}" for s in range(args.seeds)) + " |")
    print("|---" * (args.seeds + 1) + "|")
    for name in settings:
        cells = [
            texts[f"{name}|{s}"].replace("\n", " ").replace("|", "\\|") for s in range(args.seeds)
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
