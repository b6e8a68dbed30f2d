"""CI cannot pass by skipping: a component the tests use that is missing fails there."""

from __future__ import annotations

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
