"""Schema-driven fuzzing: schemathesis generates requests from the service's own
OpenAPI document and sends them to a live server.

Every operation gets valid-by-schema (positive) and invalid-by-schema (negative)
requests; the session paths also get them aimed at a real session, so that
generation, locking and storing run and not just the 404 path. Each answer must
be no 5xx, conform to the schema where the schema says something, and come back
within a timeout (no hang). Afterwards the engine still serves a normal turn,
no KV block stays referenced, and no stored session is half-written.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
)

from tests.reliability.conftest import (
    ADMIN_KEY,
    FUZZ_KEY,
    RELIABILITY_LIMITS,
    cache_idle_report,
    client,
    new_session,
    say,
    session_problems,
    start_server,
    unique,
)

# Requests per (operation, mode); the total is asserted below. Override to fuzz longer.
EXAMPLES = int(os.environ.get("CHATSVC_FUZZ_EXAMPLES", "130"))
MIN_REQUESTS = 2_000
REQUEST_TIMEOUT_S = 60
# Generation is the only slow thing a request can ask for; two tokens keep
# thousands of requests within minutes on two cores.
FUZZ_LIMITS = replace(RELIABILITY_LIMITS, max_tokens_cap=2, max_sessions_per_tenant=300)


@pytest.fixture(scope="module")
def fuzz_server(redis_server):
    with start_server(redis_server.url, FUZZ_LIMITS) as live:
        yield live


def test_schema_documents_the_real_error_body(fuzz_server):
    """Regression (fuzz finding): Litestar documented its own ``{status_code, detail}``
    body for 400, while every error the service sends is ``{"error": {...}}``."""
    with client(fuzz_server, FUZZ_KEY) as http:
        document = http.get("/schema/openapi.json").json()
        answer = http.get("/sessions", params={"cursor": "not-a-cursor"})
    assert answer.status_code == 400
    assert set(answer.json()) == {"error"}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if not status.startswith("4"):
                    continue
                schema = response["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (method, path, status)


def _key_for(path: str) -> str:
    return ADMIN_KEY if path.startswith("/admin") or path == "/metrics" else FUZZ_KEY


def _strategies(schema, session_id: str, model: str):
    """(label, operation, strategy) for every operation and mode, plus the session
    operations aimed at a live session."""
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(generation_mode=mode)
            yield f"{operation.label} {mode.value}", operation, strategy
            # Deleting the live session would turn every later aimed request into a 404.
            if "{session_id}" in operation.path and operation.method.upper() != "DELETE":
                aimed = operation.as_strategy(
                    generation_mode=mode, path_parameters={"session_id": session_id}
                )
                yield f"{operation.label} {mode.value} live-session", operation, aimed
            if operation.path == "/v1/chat/completions" and mode is GenerationMode.POSITIVE:
                yield (
                    f"{operation.label} served-model",
                    operation,
                    strategy.map(lambda case: _with_model(case, model)),
                )


def _with_model(case, model: str):
    # A random model name only reaches the 404 branch; naming the served model
    # lets valid bodies through to generation.
    if isinstance(case.body, dict):
        case.body = {**case.body, "model": model}
    return case


def _run_fuzz(strategy, call, examples: int) -> None:
    """Send ``examples`` cases of ``strategy`` through ``call``; hypothesis shrinks a failure."""

    @given(case=strategy)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        derandomize=True,
    )
    def fuzz(case) -> None:
        call(case)

    fuzz()


def test_schema_fuzz(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/schema/openapi.json")
    with client(fuzz_server, FUZZ_KEY) as http:
        live_session = new_session(http)["id"]
        model = http.get("/v1/models").json()["data"][0]["id"]
    counts: dict[str, int] = {}
    statuses: dict[int, int] = {}
    failures: list[str] = []
    unsatisfiable: list[str] = []
    checks = [not_a_server_error, content_type_conformance, response_schema_conformance]

    with requests.Session() as session:
        for label, operation, strategy in _strategies(schema, live_session, model):
            headers = {"Authorization": f"Bearer {_key_for(operation.path)}"}

            def call(case, label=label, headers=headers) -> None:
                response = case.call(
                    base_url=fuzz_server.url,
                    session=session,
                    headers=headers,
                    timeout=REQUEST_TIMEOUT_S,
                )
                counts[label] = counts.get(label, 0) + 1
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                case.validate_response(response, checks=checks, headers=headers)

            # Every operation is fuzzed even after one fails, so a run reports them all.
            try:
                _run_fuzz(strategy, call, EXAMPLES)
            except Unsatisfiable:
                # Negative mode on an operation with nothing to violate (no
                # constrained parameter, no body): there is no invalid request to send.
                unsatisfiable.append(label)
            except (Exception, BaseExceptionGroup) as exc:  # noqa: BLE001 - asserted below
                failures.append(f"{label}: {exc}")

    total = sum(counts.values())
    print(f"\nfuzz: {total} requests, {len(counts)} (operation, mode) pairs; statuses {statuses}")
    print(f"fuzz: no negative cases exist for {unsatisfiable}")
    assert all("negative" in label for label in unsatisfiable), unsatisfiable
    assert failures == [], "\n\n".join(failures)
    assert total >= MIN_REQUESTS, counts
    assert not any(status >= 500 for status in statuses)

    # The engine still serves a normal turn, nothing stays referenced, nothing is half-written.
    with client(fuzz_server, FUZZ_KEY) as http:
        sid = new_session(http)["id"]
        turn = say(http, sid, unique("Say hello."), max_tokens=2)
        assert turn["usage"]["completion_tokens"] >= 1
    with client(fuzz_server, ADMIN_KEY) as admin:
        report = cache_idle_report(admin)
    assert report["integrity"] == "ok", report["integrity"]
    assert report["engine"]["device"]["used"] == 0, report["engine"]["device"]
    assert report["engine"]["num_sequences"] == 0
    assert session_problems(fuzz_server, FUZZ_KEY) == []
