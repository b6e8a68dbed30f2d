"""NVIDIA's AIPerf against our service: its chat, completions and multi-turn profiles.

    python -m bench.compat.aiperf_profiles            # the documented profiles
    python -m bench.compat.aiperf_profiles --smoke    # a few requests each (the test suite's)
    python -m bench.compat.aiperf_profiles --url http://127.0.0.1:8000   # a running service

This proves compatibility, not speed: AIPerf's pacing loop takes a whole core, so on
a small machine it competes with the engine for the CPU. Every request carries
``ignore_eos: true`` (``--extra-inputs``), as AIPerf users send to fix output lengths,
and AIPerf reads usage from the server (``--use-server-token-count``), so its report
shows the prompt tokens the prefix cache served (``usage_prompt_cache_read_tokens``).
The tokenizer is the local model directory, never a hub name.

Profiles (synthetic prompts, seeded):

- ``chat``        streaming chat; prompts share one of 2 prefixes of 64 tokens
- ``completions`` ``/v1/completions``, the same prompts' shape
- ``multiturn``   streaming chat conversations of 3 turns resending their history,
                  with a 64-token system prompt shared by all

Artifacts (AIPerf's own CSV/JSON) under ``bench/results/aiperf/<profile>/``.
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from pathlib import Path

from bench.compat.tools import (
    RESULTS,
    default_model_dir,
    offline_env,
    our_server,
    run,
    served_model,
    tool,
)

PROFILES: dict[str, list[str]] = {
    "chat": [
        "--endpoint-type", "chat", "--streaming",
        "--num-prefix-prompts", "2", "--prefix-prompt-length", "64",
    ],
    "completions": [
        "--endpoint-type", "completions",
        "--num-prefix-prompts", "2", "--prefix-prompt-length", "64",
    ],
    "multiturn": [
        "--endpoint-type", "chat", "--streaming",
        "--conversation-num", "{conversations}", "--conversation-turn-mean", "3",
        "--conversation-turn-stddev", "0", "--shared-system-prompt-length", "64",
    ],
}  # fmt: skip
# AIPerf's metric tags the summary prints (sums over the run where AIPerf has them).
SUMMARY = (
    ("request_count", "requests"),
    ("error_request_count", "errors"),
    ("total_usage_prompt_tokens", "prompt tokens (server)"),
    ("total_usage_prompt_cache_read_tokens", "cached tokens (server)"),
    ("total_output_tokens", "output tokens"),
    ("output_sequence_length", "output tokens / request"),
)


def aiperf_argv(profile: str, url: str, model: str, model_dir: Path, args, out: Path) -> list[str]:
    shape = [a.format(conversations=args.conversations) for a in PROFILES[profile]]
    return [
        str(tool("aiperf", "aiperf")), "profile",
        "--model", model, "--url", url, "--tokenizer", str(model_dir),
        *shape,
        "--prompt-input-tokens-mean", str(args.input_tokens), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(args.output_tokens),
        "--prompt-output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true",
        "--use-server-token-count",
        "--concurrency", str(args.concurrency),
        "--request-count", str(args.requests),
        "--warmup-request-count", "1",
        "--random-seed", "0",
        "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry",
        "--output-artifact-dir", str(out),
    ]  # fmt: skip


def aiperf_env() -> dict[str, str]:
    """AIPerf's environment. Its offline mode (HF_HUB_OFFLINE=1) looks a tokenizer up in
    the hub's cache only and refuses a directory; a local directory loads without it,
    and loading a directory contacts no hub."""
    env = offline_env()
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    return env


def summary(out: Path) -> dict[str, float | None]:
    """AIPerf's figures of one profile, from its JSON export."""
    found = sorted(out.rglob("profile_export_aiperf.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"AIPerf wrote no profile_export_aiperf.json under {out}")
    data = json.loads(found[-1].read_text())
    figures: dict[str, float | None] = {}
    for tag, _ in SUMMARY:
        entry = data.get(tag)
        if isinstance(entry, dict):
            figures[tag] = entry.get("sum", entry.get("avg"))
            if tag == "output_sequence_length":
                figures[tag] = entry.get("avg")
        else:
            figures[tag] = entry
    if figures.get("error_request_count") is None and figures.get("request_count"):
        figures["error_request_count"] = 0  # AIPerf lists the metric only when there are errors
    return figures


def report(results: dict[str, dict]) -> str:
    lines = ["| profile | " + " | ".join(h for _, h in SUMMARY) + " |"]
    lines.append("|---" * (len(SUMMARY) + 1) + "|")
    for profile, figures in results.items():
        cells = [_cell(figures.get(tag)) for tag, _ in SUMMARY]
        lines.append(f"| {profile} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) and not value.is_integer() else f"{value:g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--url", default=None, help="a running service (default: start one)")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="6 requests, 2 conversations, short")
    parser.add_argument("--out", type=Path, default=RESULTS / "aiperf")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.conversations, args.concurrency = 6, 2, 2
        args.input_tokens, args.output_tokens = 32, 8
    profiles = [p for p in args.profiles.split(",") if p]
    unknown = set(profiles) - set(PROFILES)
    if unknown:
        parser.error(f"unknown profiles {sorted(unknown)}; known: {sorted(PROFILES)}")
    model_dir = args.model_dir or default_model_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    server = our_server(model_dir, args.out) if args.url is None else nullcontext()
    results = {}
    with server as running:
        url = args.url or running.base_url
        model = served_model(url) if running is None else running.model
        for profile in profiles:
            out = args.out / profile
            argv = aiperf_argv(profile, url, model, model_dir, args, out)
            run(argv, args.out / f"{profile}-aiperf.log", aiperf_env())
            results[profile] = summary(out)
    text = report(results)
    (args.out / "report.md").write_text(text + "\n")
    (args.out / "report.json").write_text(json.dumps(results, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
