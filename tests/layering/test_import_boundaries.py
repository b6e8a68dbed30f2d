"""The layering, checked by importing each layer with what it must not use forbidden.

    cache/            no torch, no chatsvc        (plain bookkeeping)
    kernels/          no chatsvc                  (tensors in, tensors out)
    chatsvc/engine/   no chatsvc.api, chatsvc.store, redis, litestar
    chatsvc/protocol  no torch, no chatsvc.engine (the engine's contract)
    chatsvc/api, chatsvc/service: no torch        (they talk to the engine through it)
    chatsvc/api       no chatsvc.engine in its own imports
    migrations/       no chatsvc                  (data the store applies)
    bench/            no tests                    (the suites import bench, not the reverse)

Each check runs in a fresh interpreter (tests/layering/import_guard.py) whose
import system refuses the forbidden names, so what is checked is the imports that
really run, optional ones included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GUARD = Path(__file__).with_name("import_guard.py")


def guarded_import(blocked: list[str], modules: list[str]) -> dict:
    # Run as a script (not -m tests...), so that the guard itself imports no package.
    result = subprocess.run(
        [sys.executable, str(GUARD), ",".join(blocked), *modules],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for package, origin in report["origins"].items():
        assert origin is not None and Path(origin).is_relative_to(REPO), (package, origin)
    return report


def assert_clean(report: dict) -> None:
    assert report["attempts"] == [], "forbidden imports: " + json.dumps(report["attempts"])
    assert report["failed"] == {}, "\n".join(report["failed"].values())


def test_cache_needs_neither_torch_nor_chatsvc():
    report = guarded_import(["torch", "chatsvc", "kernels"], ["cache.*"])
    assert_clean(report)
    assert "cache.manager" in report["imported"]


def test_kernels_know_nothing_of_chatsvc():
    report = guarded_import(["chatsvc"], ["kernels.*"])
    assert_clean(report)
    assert "kernels.step" in report["imported"] and "kernels.backend" in report["imported"]


def test_engine_never_imports_http_or_redis():
    blocked = ["chatsvc.api", "chatsvc.store", "chatsvc.service", "redis", "litestar"]
    report = guarded_import(blocked, ["chatsvc.engine.*"])
    assert_clean(report)
    assert "chatsvc.engine.async_engine" in report["imported"]


def test_protocol_loads_without_torch_or_the_engine():
    # The engine implements the contract and imports it, never the reverse.
    blocked = ["torch", "transformers", "kernels", "chatsvc.engine"]
    report = guarded_import(blocked, ["chatsvc.protocol.*"])
    assert_clean(report)
    assert "chatsvc.protocol.client" in report["imported"]


def test_engine_package_and_config_load_without_torch():
    # The package's names load on first use, so its torch-free modules stay torch-free.
    modules = ["chatsvc.engine", "chatsvc.engine.config"]
    report = guarded_import(["torch", "transformers", "kernels"], modules)
    assert_clean(report)


def test_api_and_service_load_without_torch():
    # They type against chatsvc.protocol; only service.build_engine loads the engine.
    modules = ["chatsvc.api.*", "chatsvc.service", "chatsvc.config", "chatsvc.__main__"]
    report = guarded_import(["torch", "transformers", "kernels"], modules)
    assert_clean(report)
    assert "chatsvc.api.app" in report["imported"]


def test_api_imports_nothing_of_the_engine():
    # Only the API's own imports: chatsvc.config loads the engine's settings
    # (chatsvc.engine.config), which the service hands to the engine it builds.
    report = guarded_import(["chatsvc.engine@chatsvc.api"], ["chatsvc.api.*"])
    assert_clean(report)
    assert "chatsvc.api.app" in report["imported"]
    assert "chatsvc.api.turn.run" in report["imported"]


def test_migrations_are_data_that_import_nothing_of_chatsvc():
    # The store applies them (chatsvc.store.schema); an import back would be a cycle.
    report = guarded_import(["chatsvc"], ["migrations.*"])
    assert_clean(report)
    assert "migrations.m0004_session_tokens_key" in report["imported"]


def test_benchmarks_import_nothing_from_the_tests():
    report = guarded_import(["tests"], ["bench.*"])
    assert_clean(report)
    assert "bench.reliability.crash_loop" in report["imported"]
    assert "bench.scaleout.affinity" in report["imported"]


def test_the_guard_sees_an_import_that_is_caught():
    # The check is only as good as its hook: an optional import inside try/except, as
    # tests.layering.optional_torch makes one, must still count.
    report = guarded_import(["torch"], ["tests.layering.optional_torch"])
    assert report["failed"] == {}
    assert report["attempts"] == [
        {"module": "torch", "imported_by": "tests.layering.optional_torch"}
    ]


def test_the_scoped_guard_sees_an_import_of_a_loaded_module():
    # kernels.kv_layout loads torch first (allowed there), so a finder is never asked
    # again; the scoped rule must still see the optional module's own import of it.
    report = guarded_import(
        ["torch@tests.layering.optional_torch"],
        ["kernels.kv_layout", "tests.layering.optional_torch"],
    )
    assert report["failed"] == {}
    assert report["attempts"] == [
        {"module": "torch", "imported_by": "tests.layering.optional_torch"}
    ]


@pytest.mark.parametrize("name", ["AsyncEngine", "EngineConfig", "ModelConfig"])
def test_engine_package_names_resolve(name):
    import chatsvc.engine

    assert getattr(chatsvc.engine, name).__name__ == name
    assert name in chatsvc.engine.__all__


def test_the_contract_types_have_one_home():
    # Requests, deltas and errors are chatsvc.protocol's; the engine names none of them.
    import chatsvc.engine

    assert not hasattr(chatsvc.engine, "SamplingParams")
    assert not hasattr(chatsvc.engine, "EngineStoppedError")
