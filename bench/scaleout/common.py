"""What every scale-out bench shares: workload options, a Redis of its own, the result file."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from bench.multiturn.runner import machine_description
from bench.multiturn.workload import Distribution, WorkloadConfig, generate_workload


def add_workload_args(p: argparse.ArgumentParser, conversations: int, turns: int) -> None:
    p.add_argument("--conversations", type=int, default=conversations)
    p.add_argument("--turns", type=int, default=turns)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--system-tokens", default="200")
    p.add_argument("--user-tokens", default="uniform:16:48")
    p.add_argument("--answer-tokens", default="uniform:16:48")
    p.add_argument("--think-time", default="uniform:0:1")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=2048,
        help="CHATSVC_NUM_GPU_BLOCKS per replica (default holds the whole workload)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per replica (default: cores / replicas, at least 1)",
    )
    p.add_argument("--out", default="bench/results")
    p.add_argument("--smoke", action="store_true", help="a tiny run that checks the harness")


def workload(args: argparse.Namespace):
    config = WorkloadConfig(
        num_conversations=args.conversations,
        num_turns=args.turns,
        num_system_prompts=max(1, args.tenants),
        num_tenants=args.tenants,
        system_prompt_tokens=Distribution.parse(args.system_tokens),
        user_tokens=Distribution.parse(args.user_tokens),
        answer_tokens=Distribution.parse(args.answer_tokens),
        think_time_s=Distribution.parse(args.think_time),
        seed=args.seed,
    )
    return generate_workload(config)


def replica_extra_env(args: argparse.Namespace, replicas: int) -> dict[str, str]:
    threads = args.threads or max(1, (os.cpu_count() or 1) // replicas)
    return {
        "CHATSVC_NUM_GPU_BLOCKS": str(args.kv_blocks),
        "CHATSVC_NUM_THREADS": str(threads),
        "CHATSVC_MAX_STREAMS_PER_TENANT": "64",
        # The whole load is one tenant's: a throughput run, not a tenant's fair share.
        "CHATSVC_TENANT_REQUESTS_PER_S": "0",
    }


def write_result(result: dict, out_dir: str, name: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / time.strftime(f"scaleout-{name}-%Y%m%d-%H%M%S.json")
    path.write_text(json.dumps(result, indent=1))
    return path


def meta(argv: list[str] | None, module: str) -> dict:
    args = sys.argv[1:] if argv is None else argv
    return {
        "command": f"python -m {module} {shlex.join(args)}".strip(),
        "machine": machine_description(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def fmt(value, unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "-"
    if unit == "%":
        return f"{100 * value:.1f} %"
    return f"{value:.{digits}f}{unit}"
