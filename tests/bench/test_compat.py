"""The compatibility runs' own pieces: lm-eval's local tasks, the score comparison, the
frameworks' report.

The runs themselves (lm-eval, AIPerf, the agent frameworks against a live service)
are scripts: ``python -m bench.compat.eval_scores --limit 10``,
``python -m bench.compat.aiperf_profiles --smoke`` and
``python -m bench.compat.frameworks`` (docs/openai.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from bench.compat import eval_scores, frameworks
from bench.compat.lmeval.make_data import HERE, as_jsonl, datasets

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_data_is_what_make_data_writes():
    for name, items in datasets().items():
        assert (HERE / "data" / name).read_text() == as_jsonl(items), name
    mc = datasets()["mc.jsonl"]
    assert len(mc) >= 200 and all(len(item["choices"]) == 4 for item in mc)
    assert all(0 <= item["label"] < 4 for item in mc)
    assert len({item["question"] for item in mc}) == len(mc)


def test_the_task_files_read_the_committed_data():
    tasks = {}
    for path in HERE.glob("*.yaml"):
        task = yaml.safe_load(path.read_text())
        tasks[task["task"]] = task
        for data_file in task["dataset_kwargs"]["data_files"].values():
            assert (REPO / data_file).is_file(), data_file
    assert set(tasks) == set(eval_scores.METRICS)
    assert tasks["chatsvc_mc"]["output_type"] == "multiple_choice"
    assert tasks["chatsvc_gen"]["output_type"] == "generate_until"


def _samples(folder: Path, run: str, task: str, rows: list[dict]) -> None:
    path = folder / run / "model" / f"samples_{task}_2026.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_per_item_comparison_reads_lm_evals_logged_samples(tmp_path):
    # lm-eval logs log-likelihoods as strings, one [value, is_greedy] per choice.
    ours = [{"doc_id": 0, "resps": [[["-4.5", "False"]], [["-1.25", "True"]]]}]
    peer = [{"doc_id": 0, "resps": [[["-4.5001", "False"]], [["-1.25", "True"]]]}]
    _samples(tmp_path, "ours", "chatsvc_mc", ours)
    _samples(tmp_path, "hf", "chatsvc_mc", peer)
    line = eval_scores.per_item(tmp_path, "ours", "hf", "chatsvc_mc")
    assert "1.00e-04" in line and "same choice 1/1" in line
    _samples(tmp_path, "ours", "chatsvc_gen", [{"doc_id": 3, "resps": [[" Paris"]]}])
    _samples(tmp_path, "hf", "chatsvc_gen", [{"doc_id": 3, "resps": [[" Paris"]]}])
    assert "identical generations 1/1" in eval_scores.per_item(
        tmp_path, "ours", "hf", "chatsvc_gen"
    )


def test_the_frameworks_report_has_a_row_per_framework_in_turn_order():
    records = [
        {"framework": "a", "turn": 1, "prompt_tokens": 40, "cached_tokens": 0},
        {"framework": "b", "turn": 1, "prompt_tokens": 41, "cached_tokens": 16},
        {"framework": "a", "turn": 2, "prompt_tokens": 90, "cached_tokens": 80},
    ]
    rows = frameworks.report(records).splitlines()[2:]
    assert rows == ["| a | 2 | 40 / 90 | 0 / 80 |", "| b | 1 | 41 | 16 |"]
