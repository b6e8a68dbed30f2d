"""lm-evaluation-harness against our service and against transformers, on the same tasks.

    python -m bench.compat.eval_scores                  # every run, every item (the record)
    python -m bench.compat.eval_scores --limit 20       # a short check that it all works
    python -m bench.compat.eval_scores --runs ours,hf   # only the completions comparison

Runs (lm-eval 0.4 in its own environment, ``bench/compat/envs.sh``):

- ``ours``       ``local-completions`` on ``/v1/completions``: ``chatsvc_mc`` (log-likelihood:
                 echo + logprobs) and ``chatsvc_gen`` (greedy generation); lm-eval's
                 "remote" tokenizer, i.e. our ``/tokenizer_info`` and ``/tokenize``
- ``hf``         lm-eval's ``hf`` model (transformers) on the same safetensors directory
- ``ours-chat``  ``local-chat-completions`` on ``/v1/chat/completions``, ``chatsvc_gen``
                 with ``--apply_chat_template``
- ``hf-chat``    ``hf`` with ``--apply_chat_template``, ``chatsvc_gen``

Both sides run in fp32 (our service with ``CHATSVC_DTYPE=fp32``), so the scores must
agree within noise; the per-item comparison shows how close: the largest difference
of a choice's log-likelihood and the share of identical generations. Tasks and data:
``bench/compat/lmeval/``. Results under ``bench/results/lm-eval/`` (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from bench.compat.tools import RESULTS, default_model_dir, offline_env, our_server, run, tool

TASKS_DIR = "bench/compat/lmeval"
RUNS = ("ours", "hf", "ours-chat", "hf-chat")
# What each of ours is compared with.
PEERS = {"ours": "hf", "ours-chat": "hf-chat"}
METRICS = {"chatsvc_mc": ("acc", "acc_norm"), "chatsvc_gen": ("exact_match",)}


def tasks_of(run_name: str) -> list[str]:
    return ["chatsvc_gen"] if run_name.endswith("-chat") else ["chatsvc_mc", "chatsvc_gen"]


def lm_eval_argv(run_name: str, model_dir: Path, args, base_url: str | None, model_id: str | None):
    """The lm_eval command line of one run."""
    argv = [str(tool("lmeval", "lm_eval"))]
    if run_name.startswith("hf"):
        argv += [
            "--model", "hf",
            "--model_args", f"pretrained={model_dir},dtype=float32",
            "--device", "cpu",
            "--batch_size", str(args.hf_batch_size),
        ]  # fmt: skip
    elif run_name == "ours":
        argv += [
            "--model", "local-completions",
            "--model_args",
            f"model={model_id},base_url={base_url}/v1/completions,tokenizer_backend=remote,"
            f"num_concurrent={args.num_concurrent},max_retries=1,tokenized_requests=True",
        ]  # fmt: skip
    else:
        argv += [
            "--model", "local-chat-completions",
            "--model_args",
            f"model={model_id},base_url={base_url}/v1/chat/completions,"
            f"num_concurrent={args.num_concurrent},max_retries=1",
        ]  # fmt: skip
    if run_name.endswith("-chat"):
        argv.append("--apply_chat_template")
    argv += [
        "--tasks", ",".join(tasks_of(run_name)),
        "--include_path", TASKS_DIR,
        "--output_path", str(args.out / run_name),
        "--log_samples",
        "--seed", "0",
    ]  # fmt: skip
    if args.limit:
        argv += ["--limit", str(args.limit)]
    return argv


def newest(folder: Path, pattern: str) -> Path:
    found = sorted(folder.rglob(pattern), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no {pattern} under {folder}")
    return found[-1]


def scores(out: Path, run_name: str) -> dict[str, dict[str, tuple[float, float]]]:
    """``{task: {metric: (value, stderr)}}`` of a finished run."""
    results = json.loads(newest(out / run_name, "results_*.json").read_text())["results"]
    table: dict[str, dict[str, tuple[float, float]]] = {}
    for task, metrics in METRICS.items():
        if task not in results:
            continue
        row = results[task]
        table[task] = {m: (row[f"{m},none"], _number(row.get(f"{m}_stderr,none"))) for m in metrics}
    return table


def samples(out: Path, run_name: str, task: str) -> dict[int, dict]:
    return {
        s["doc_id"]: s
        for s in map(json.loads, newest(out / run_name, f"samples_{task}_*.jsonl").open())
    }


def per_item(out: Path, ours: str, peer: str, task: str) -> str:
    """How close the two runs are item by item."""
    a, b = samples(out, ours, task), samples(out, peer, task)
    common = sorted(set(a) & set(b))
    if task == "chatsvc_mc":
        diffs = [
            abs(x[0] - y[0])
            for i in common
            for x, y in zip(_loglikelihoods(a[i]), _loglikelihoods(b[i]), strict=True)
        ]
        same = sum(_choice(a[i]) == _choice(b[i]) for i in common)
        return (
            f"{len(common)} items: max |delta log-likelihood| {max(diffs):.2e}, "
            f"same choice {same}/{len(common)}"
        )
    same = sum(_generation(a[i]) == _generation(b[i]) for i in common)
    return f"{len(common)} items: identical generations {same}/{len(common)}"


def _loglikelihoods(sample: dict) -> list[tuple[float, bool]]:
    # lm-eval logs them as strings: [["-4.54", "False"]] per choice.
    return [(float(r[0][0]), str(r[0][1]) == "True") for r in sample["resps"]]


def _choice(sample: dict) -> int:
    values = [ll for ll, _ in _loglikelihoods(sample)]
    return values.index(max(values))


def _generation(sample: dict) -> str:
    return sample["resps"][0][0]


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def report(out: Path, names: list[str]) -> str:
    table = {name: scores(out, name) for name in names}
    lines = [
        "| task | metric | ours | transformers | stderr | agree | per item |",
        "|---|---|---|---|---|---|---|",
    ]
    for ours, peer in PEERS.items():
        if ours not in table or peer not in table:
            continue
        for task, metrics in table[ours].items():
            detail = per_item(out, ours, peer, task)
            for metric, (value, stderr) in metrics.items():
                other, other_err = table[peer][task][metric]
                noise = 2 * math.hypot(stderr, other_err)
                agree = abs(value - other) <= noise if not math.isnan(noise) else value == other
                lines.append(
                    f"| {task} ({ours} vs {peer}) | {metric} | {value:.4f} | {other:.4f} | "
                    f"{stderr:.4f} | {'yes' if agree else 'NO'} | {detail} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated of {RUNS}")
    parser.add_argument("--limit", type=int, default=0, help="items per task (0 = all)")
    parser.add_argument("--num-concurrent", type=int, default=2)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "lm-eval")
    parser.add_argument("--report-only", action="store_true", help="tabulate the last runs")
    args = parser.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    unknown = set(names) - set(RUNS)
    if unknown:
        parser.error(f"unknown runs {sorted(unknown)}; known: {RUNS}")
    if args.report_only:
        print(report(args.out, names))
        return 0
    model_dir = args.model_dir or default_model_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in [n for n in names if n.startswith("hf")]:
        run(lm_eval_argv(name, model_dir, args, None, None), args.out / f"{name}-lm_eval.log")
    ours = [n for n in names if n.startswith("ours")]
    if ours:
        with our_server(model_dir, args.out, dtype="fp32") as server:
            for name in ours:
                argv = lm_eval_argv(name, model_dir, args, server.base_url, server.model)
                run(argv, args.out / f"{name}-lm_eval.log", offline_env())
    text = report(args.out, names)
    (args.out / "report.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
