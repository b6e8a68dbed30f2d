"""Agent and chat frameworks against our service: three-turn conversations through
LangChain, the OpenAI Agents SDK and Pydantic AI, each keeping its history its own way.

    python -m bench.compat.frameworks                          # start a service, run all
    python -m bench.compat.frameworks --url http://127.0.0.1:8000   # a running local service

The frameworks run in their own environment (``bench/compat/envs.sh frameworks``,
made on first use) and talk to the service over HTTP only
(``bench/compat/framework_chats.py``). This proves compatibility: every turn is
answered, and from the second turn on the prefix cache serves the history the
framework sends back (its messages, its replayed answers, or ``previous_response_id``).
The table and the JSON lines go to ``bench/results/frameworks/``.
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from pathlib import Path

from bench.compat.tools import (
    REPO,
    RESULTS,
    default_model_dir,
    our_server,
    run,
    served_model,
    tool,
)


def report(records: list[dict]) -> str:
    """One row per framework: each turn's prompt tokens and the cached part of them."""
    by_framework: dict[str, list[dict]] = {}
    for record in records:
        by_framework.setdefault(record["framework"], []).append(record)
    lines = ["| framework | turns | prompt tokens per turn | cached tokens per turn |"]
    lines.append("|---|---|---|---|")
    for name, turns in by_framework.items():
        prompt = " / ".join(str(t["prompt_tokens"]) for t in turns)
        cached = " / ".join(str(t["cached_tokens"]) for t in turns)
        lines.append(f"| {name} | {len(turns)} | {prompt} | {cached} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--url", default=None, help="a running local-mode service")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS / "frameworks")
    args = parser.parse_args(argv)
    python = tool("frameworks", "python")
    args.out.mkdir(parents=True, exist_ok=True)
    server = (
        our_server(args.model_dir or default_model_dir(), args.out)
        if args.url is None
        else nullcontext()
    )
    log = args.out / "chats.jsonl"
    with server as running:
        url = args.url or running.base_url
        model = served_model(url) if running is None else running.model
        script = REPO / "bench" / "compat" / "framework_chats.py"
        argv = [str(python), str(script), "--url", url, "--model", model]
        run([*argv, "--max-tokens", str(args.max_tokens)], log)
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    text = report(records)
    (args.out / "report.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
