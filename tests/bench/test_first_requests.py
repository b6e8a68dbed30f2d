"""bench.first_requests: its prompts share no cacheable prefix, and a run prints its figures."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.first_requests import prompt_messages
from bench.live_server import free_port

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16  # the engine's default block size: a prefix hit needs a whole shared block


def test_prompts_are_one_shape_and_share_under_a_block(tokenizer):
    texts = [
        tokenizer.apply_chat_template(
            prompt_messages(i, 300), add_generation_prompt=True, tokenize=False
        )
        for i in range(10)
    ]
    rendered = [tokenizer.encode(text) for text in texts]
    lengths = [len(ids) for ids in rendered]
    assert max(lengths) - min(lengths) <= 20 and 280 <= min(lengths) <= 360
    for i, a in enumerate(rendered):
        for b in rendered[i + 1 :]:
            shared = next(n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            assert shared < BLOCK
    assert prompt_messages(3, 300) == prompt_messages(3, 300)  # the same run twice


@pytest.mark.slow
def test_a_fresh_start_reports_every_request():
    result = subprocess.run(
        [sys.executable, "-m", "bench.first_requests", "--requests", "2", "--prompt-words", "20",
         "--max-tokens", "2", "--threads", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"/readyz 200 after [\d.]+s", result.stdout)
    rows = re.findall(r"^\s+\d+\s+[\d.]+\s+[\d.]+\s+(\d+)\s+(\d+)\s+\d+$", result.stdout, re.M)
    assert len(rows) == 2 and all(cached == "0" for _, cached in rows)
    assert re.search(r"first/last \(2th\) TTFT = [\d.]+x", result.stdout)
    assert re.search(r"stop on SIGTERM took [\d.]+s", result.stdout)


def _serving_on(port: int) -> list[int]:
    """Pids of the processes running ``chatsvc serve --port <port>``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"chatsvc" in argv and b"serve" in argv and str(port).encode() in argv:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_bench_killed_by_a_timeout_leaves_no_service_behind(tmp_path):
    """A SIGKILLed bench (a test's timeout) must not leave its service, and with it an
    embedded Valkey, running on the machine."""
    port = free_port()
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench.first_requests", "--port", str(port), "--requests", "2"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        # Killed, the bench cannot remove its data dir: it goes where pytest cleans up.
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _serving_on(port):
            assert bench.poll() is None and time.monotonic() < deadline, "no service started"
            time.sleep(0.1)
        service = _serving_on(port)
        bench.send_signal(signal.SIGKILL)
        bench.wait()
        deadline = time.monotonic() + 60
        while _serving_on(port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _serving_on(port), f"the service {service} outlived its bench"
    finally:
        for pid in _serving_on(port):
            os.kill(pid, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()
