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
from hypothesis.errors import Unsatisfiable
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
from tests.reliability.fuzzing import operation_strategies, run_examples

# Requests per (operation, mode); the total is asserted below. Override to fuzz longer.
EXAMPLES = int(os.environ.get("CHATSVC_FUZZ_EXAMPLES", "60"))
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


def test_schema_fuzz(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/schema/openapi.json")
    with client(fuzz_server, FUZZ_KEY) as http:
        live_session = new_session(http)["id"]
        live_conversation = http.post("/v1/conversations", json={}).json()["id"]
        model = http.get("/v1/models").json()["data"][0]["id"]
    counts: dict[str, int] = {}
    statuses: dict[int, int] = {}
    failures: list[str] = []
    unsatisfiable: list[str] = []
    checks = [not_a_server_error, content_type_conformance, response_schema_conformance]

    with requests.Session() as session:
        operations = operation_strategies(schema, live_session, model, live_conversation)
        for label, operation, strategy in operations:
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
                run_examples(strategy, call, EXAMPLES)
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
