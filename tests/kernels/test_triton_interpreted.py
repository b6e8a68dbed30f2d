"""Runs ``triton_checks.py`` (Triton kernels vs the references), ``triton_span_checks.py``
(the invariant kernels), ``triton_checks_kv_int8.py`` (int8 KV) and
``triton_checks_kv_bf16.py`` (bf16 KV under fp32) in one subprocess.

Triton binds its interpreter when it is first imported, and the rest of the
suite (the engine tests) must keep the torch path on CPU, so the comparisons
get a fresh interpreter process with ``TRITON_INTERPRET=1`` of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECKS = [
    Path(__file__).with_name(name)
    for name in (
        "triton_checks.py",
        "triton_span_checks.py",
        "triton_checks_kv_int8.py",
        "triton_checks_kv_bf16.py",
    )
]
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_match_references_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("CHATSVC_KERNEL_BACKEND", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *map(str, CHECKS), "-q", "-p", "no:cacheprovider"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


NO_TRITON_SCRIPT = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import torch
import kernels
from kernels.triton_compat import HAS_TRITON
assert not HAS_TRITON
pool = torch.randn(4, 8, 1, 16)
out = kernels.paged_decode_attention(
    torch.randn(1, 2, 16), pool, pool.clone(), torch.tensor([[2, 0]], dtype=torch.int32),
    torch.tensor([11], dtype=torch.int32), 0.25,
)
assert out.shape == (1, 2, 16) and torch.isfinite(out).all()
try:
    kernels.paged_decode_attention(
        torch.randn(1, 2, 16), pool, pool.clone(), torch.tensor([[2, 0]], dtype=torch.int32),
        torch.tensor([11], dtype=torch.int32), 0.25, backend="triton",
    )
except ValueError as exc:
    assert "not installed" in str(exc)
else:
    raise AssertionError("the triton backend ran without triton")
print("ok")
"""


def test_without_triton_the_torch_path_still_works():
    result = subprocess.run(
        [sys.executable, "-c", NO_TRITON_SCRIPT],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
