"""``python -m bench.multiturn``: run the multi-turn benchmark and write its figures.

Defaults (16 conversations x 6 turns, concurrency 8) are the target configuration;
``--smoke`` runs a tiny one that only checks the harness end to end.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.multiturn.report import markdown_table, plot
from bench.multiturn.runner import (
    RunOptions,
    machine_description,
    resolve_model_dir,
    run_system,
    write_result,
)
from bench.multiturn.servers import SYSTEMS
from bench.multiturn.workload import Distribution, WorkloadConfig, generate_workload, load_replay

SMOKE = WorkloadConfig(
    num_conversations=2,
    num_turns=2,
    num_system_prompts=1,
    system_prompt_tokens=Distribution.parse("40"),
    user_tokens=Distribution.parse("8"),
    answer_tokens=Distribution.parse("4"),
    think_time_s=Distribution.parse("0"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__)
    p.add_argument("--systems", default="ours,ours-nocache,hf,hf-cb", help=", ".join(SYSTEMS))
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--system-prompts", type=int, default=4, help="distinct shared system prompts")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument(
        "--system-tokens", default="200", help="const:V | uniform:LO:HI | lognormal:MEDIAN:SIGMA"
    )
    p.add_argument("--user-tokens", default="uniform:16:48")
    p.add_argument("--answer-tokens", default="uniform:16:48")
    p.add_argument("--think-time", default="uniform:0:1", help="seconds before each later turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay", help="JSONL of conversations (a list of user turns per line)")
    p.add_argument(
        "--model-dir", help="safetensors model directory (default: our converted default model)"
    )
    p.add_argument("--block-size", type=int, default=16, help="granularity of the ideal hit rate")
    p.add_argument(
        "--max-context-len",
        type=int,
        default=None,
        help="static allocation per request (default: longest request of the trace)",
    )
    p.add_argument(
        "--max-system-s",
        type=float,
        default=180.0,
        help="cut each system's run after this many seconds (0 = no limit); cut runs are marked",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for every server (default: unset, torch uses one per core)",
    )
    p.add_argument("--out", default="bench/results", help="directory for JSON, PNG and markdown")
    p.add_argument("--smoke", action="store_true", help="tiny config: 2 conversations x 2 turns")
    return p


def workload_from_args(args: argparse.Namespace):
    if args.smoke:
        config = replace(SMOKE, seed=args.seed)
    else:
        config = WorkloadConfig(
            num_conversations=args.conversations,
            num_turns=args.turns,
            num_system_prompts=args.system_prompts,
            num_tenants=args.tenants,
            system_prompt_tokens=Distribution.parse(args.system_tokens),
            user_tokens=Distribution.parse(args.user_tokens),
            answer_tokens=Distribution.parse(args.answer_tokens),
            think_time_s=Distribution.parse(args.think_time),
            seed=args.seed,
        )
    return load_replay(args.replay, config) if args.replay else generate_workload(config)


def _exit_on_signal(signum: int, _frame: object) -> None:
    # SystemExit unwinds through the servers' context managers, so they are stopped; a
    # background job's SIGINT is ignored by default, hence SIGTERM as well.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run(args, argv)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Run every chosen system on one workload; write JSON, markdown and PNG."""
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    workload = workload_from_args(args)
    concurrency = min(args.concurrency, 2) if args.smoke else args.concurrency
    options = RunOptions(
        concurrency=concurrency,
        block_size=args.block_size,
        max_context_len=args.max_context_len,
        threads=args.threads,
        deadline_s=args.max_system_s if args.max_system_s > 0 else None,
    )
    model_dir = resolve_model_dir(args.model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    out_dir = Path(args.out)
    stem = time.strftime("multiturn-%Y%m%d-%H%M%S")
    command = (
        "python -m bench.multiturn " + shlex.join(sys.argv[1:] if argv is None else argv)
    ).strip()
    result = {
        "meta": {
            "command": command,
            "machine": machine_description(),
            "workload": workload.description,
            "num_requests": workload.num_requests,
            "concurrency": concurrency,
            "model_dir": str(model_dir),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "workload": workload.to_json(),
        "systems": {},
    }
    for system in systems:
        print(f"[bench] {system}: starting", flush=True)
        entry = run_system(system, workload, model_dir, out_dir / stem, options, tokenizer)
        result["systems"][system] = entry
        errors = sum(1 for r in entry["records"] if r["error"])
        cut = sum(1 for r in entry["records"] if r["cut_at_deadline"])
        note = f", cut at the deadline with {cut} in flight" if entry["truncated"] else ""
        print(f"[bench] {system}: {entry['wall_s']:.1f}s, {errors} errors{note}", flush=True)
        write_result(result, out_dir, stem)
    path = write_result(result, out_dir, stem)
    table = markdown_table(result)
    (out_dir / f"{stem}.md").write_text(f"`{command}`\n\n{result['meta']['machine']}\n\n{table}")
    png = plot(result, out_dir / f"{stem}.png")
    print(table)
    print(f"[bench] wrote {path}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
