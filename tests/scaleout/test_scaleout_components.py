"""CI cannot pass by skipping: a component the tests use that is missing fails there."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.components import missing_component

REPO = Path(__file__).resolve().parents[2]


def test_a_missing_component_fails_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        missing_component("nginx cannot be installed here")


def test_a_missing_component_skips_elsewhere(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="nginx"):
        missing_component("nginx cannot be installed here")


def test_dev_installs_what_the_tests_use_before_running_them():
    # ./dev test runs the install step first; with nginx present it is silent.
    script = (REPO / "dev").read_text()
    assert 'test) ensure_test_components; exec "$VPY" -m pytest' in script
    found = subprocess.run(
        [
            "bash",
            "-c",
            f'source <(sed -n "/^ensure_test_components()/,/^}}/p" {REPO / "dev"}); '
            "ensure_test_components",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert found.returncode == 0, found.stderr


def test_a_first_install_without_room_for_it_stops_at_once_and_says_why(tmp_path):
    # A fresh checkout (no .venv) on a filesystem that `df` says is nearly full: the
    # install stops before pip starts, naming the room it needs and the room there is.
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "dev").write_bytes((REPO / "dev").read_bytes())
    (checkout / "dev").chmod(0o755)
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "df").write_text(
        "#!/bin/sh\necho 'Filesystem 1048576-blocks Used Available Capacity Mounted on'\n"
        "echo 'fake 100000 99900 100 100% /'\n"
    )
    (tools / "df").chmod(0o755)
    path = f"{tools}:{os.environ['PATH']}"
    done = subprocess.run(
        ["./dev", "test"],
        cwd=checkout,
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "needs about 3072 MB free" in done.stderr and "has 100 MB" in done.stderr
    # Nothing was installed: the venv holds no torch (pip never ran).
    assert not list((checkout / ".venv").glob("lib/python*/site-packages/torch"))
