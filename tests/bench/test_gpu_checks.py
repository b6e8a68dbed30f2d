"""bench/gpu_checks.py (run by bench/gpu_check.sh on a GPU) keeps working without one.

On the CPU the kernel check says it needs CUDA, the disk-tier check (a restart served
from files) runs the same code on CPU tensors, and the invariance check compares the
torch backend's rows and the fp32 model's logits and K/V over chunkings and companions.
The host-swap check's engine path is tests/engine/test_engine.py's small-pool test; here
it would only add minutes.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench import gpu_checks

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_engine_checks_pass_on_the_cpu(capsys):
    failures = gpu_checks.main(
        [
            "--device",
            "cpu",
            "--skip",
            "conversation,host_swaps",
            "--turns",
            "1",
            "--max-tokens",
            "4",
        ]  # fmt: skip
    )
    out = capsys.readouterr().out
    assert failures == 0, out
    assert "kernels       SKIP" in out and "disk_tier     PASS" in out
    assert (
        "invariance    PASS" in out and "| model logits + K/V | fp32 | 14 | bit-identical |" in out
    )


def test_the_script_exits_cleanly_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the script would run the real checks")
    result = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "no CUDA device" in result.stdout
