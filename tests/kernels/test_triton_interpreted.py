"""Runs ``triton_checks.py`` (Triton kernels vs the references) in a subprocess.

Triton binds its interpreter when it is first imported, and the rest of the
suite (the engine tests) must keep the torch path on CPU, so the comparisons
get a fresh interpreter process with ``TRITON_INTERPRET=1`` of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECKS = Path(__file__).with_name("triton_checks.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_match_references_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("CHATSVC_KERNEL_BACKEND", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(CHECKS), "-q", "-p", "no:cacheprovider"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
