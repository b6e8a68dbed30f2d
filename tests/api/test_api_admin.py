"""Admin endpoints, Prometheus metrics and the health probes."""

from __future__ import annotations

import socket

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.live_server import wait_until
from chatsvc.api import http_server
from tests.api.conftest import new_session, say, unique


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """Samples by (name, labels); the ``replica`` label every sample carries is left out."""
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    assert all(s.labels.get("replica") for s in samples)
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica"))): s.value
        for s in samples
    }


def test_admin_endpoints_need_the_admin_key(acme, api):
    for path in ("/admin/cache", "/metrics"):
        assert acme.get(path).status_code == 403  # a tenant key is not enough
        assert httpx.get(api.url + path).status_code == 401


def test_cache_stats_cover_engine_and_requests(admin, acme):
    session = new_session(acme, system_prompt=unique("Be brief."))
    say(acme, session["id"], unique("One."))
    say(acme, session["id"], unique("Two."))
    stats = admin.get("/admin/cache").json()
    engine = stats["engine"]
    for key in ("device", "host", "indexed_blocks"):
        assert key in engine
    # The KV dtype and the pool's blocks, as the start-up log names them: the model's
    # dtype by default (CHATSVC_KV_DTYPE=auto), the blocks the config asked for.
    assert engine["kv_dtype"] in ("bfloat16", "float32")
    assert engine["device"]["total"] == 512
    overall = stats["requests"]["overall"]
    assert overall["requests"] >= 2
    assert 0 < overall["cached_tokens"] <= overall["prompt_tokens"]
    assert 0 < overall["token_hit_rate"] <= 1


def test_metrics_count_prompt_and_cached_tokens(admin, acme):
    before = _samples(admin.get("/metrics").text)
    session = new_session(acme)
    first = say(acme, session["id"], unique("Alpha."))
    second = say(acme, session["id"], unique("Beta."))
    response = admin.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = _samples(response.text)

    def delta(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    prompt = first["usage"]["prompt_tokens"] + second["usage"]["prompt_tokens"]
    cached = first["usage"]["cached_tokens"] + second["usage"]["cached_tokens"]
    assert delta("chatsvc_prefix_cache_queries_tokens_total") == prompt
    # Hits carry the tier they came from; together they are the request's cached tokens.
    hits = sum(
        delta("chatsvc_prefix_cache_hits_tokens_total", (("tier", tier),))
        for tier in ("device", "host", "disk")
    )
    assert hits == cached > 0
    ok = (("endpoint", "session_turn"), ("status", "ok"))
    assert delta("chatsvc_requests_total", ok) == 2
    assert delta("chatsvc_time_to_first_token_seconds_count") == 2
    assert after[("chatsvc_kv_cache_blocks_total", (("tier", "device"),))] > 0
    assert ("chatsvc_kv_cache_usage_ratio", (("tier", "host"),)) in after


def test_a_connection_cut_by_the_head_deadline_shows_in_the_metrics(admin, api, monkeypatch):
    registry = api.services.metrics.registry
    name, labels = "chatsvc_connections_cut_total", {"reason": "head_timeout"}

    def cuts() -> float:
        return registry.get_sample_value(name, labels) or 0

    # Read in the process, not over HTTP: an answer given while the deadline is short
    # would give that client's connection the short deadline too (it is armed as the
    # answer completes), and its cut would be counted as well.
    before = cuts()
    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_S", 1.0)
    with socket.create_connection(("127.0.0.1", api.port), timeout=30) as silent:
        silent.settimeout(20)
        assert silent.recv(1) == b""  # closed by the server, unanswered
    wait_until(lambda: cuts() == before + 1, 10, "the cut to be counted")
    # What the operator scrapes.
    scraped = _samples(admin.get("/metrics").text)
    assert scraped[(name, tuple(labels.items()))] == before + 1


def test_health_and_readiness_need_no_key(api):
    assert httpx.get(api.url + "/healthz").json()["status"] == "ok"
    ready = httpx.get(api.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"engine": "ok", "store": "ok"}
    assert httpx.get(api.url + "/health").json() == ready.json()
    for path in ("/healthz", "/readyz", "/health"):  # uptime monitors probe with HEAD
        head = httpx.head(api.url + path)
        assert head.status_code == 200 and head.content == b""


def test_openapi_schema_documents_every_endpoint(api):
    schema = httpx.get(api.url + "/schema/openapi.json").json()
    for path in (
        "/sessions",
        "/sessions/{session_id}",
        "/sessions/{session_id}/messages",
        "/system-prompts",
        "/v1/chat/completions",
        "/v1/models",
        "/admin/cache",
        "/metrics",
        "/healthz",
        "/readyz",
    ):
        assert path in schema["paths"], path
    for name in ("PostMessage", "TurnResult", "ChatCompletionRequest", "ChatCompletion"):
        assert name in schema["components"]["schemas"], name
