"""The shipped deploy/nginx/nginx.conf, run by a real nginx in front of small recording backends.

What the config promises, each checked on the wire: a session's requests
(by path, or by X-Session-Id header) always reach one backend, requests
without a session go round-robin, removing a backend moves only its own
sessions (consistent hashing), a connect failure moves the request on, a
request a backend received and dropped is retried only when it is idempotent,
and streamed responses pass through chunk by chunk.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from bench.live_server import free_port
from bench.scaleout.nginx import Nginx
from tests.scaleout.backends import Backend, Recorder


@pytest.fixture(scope="module")
def pair(nginx_binary, tmp_path_factory):
    recorder = Recorder()
    backends = [Backend("a", recorder), Backend("b", recorder)]
    proxy = Nginx(tmp_path_factory.mktemp("nginx"), [b.address for b in backends]).start()
    try:
        yield proxy, backends, recorder
    finally:
        proxy.stop()
        for backend in backends:
            backend.stop()


def _sid() -> str:
    return uuid.uuid4().hex


def test_the_shipped_config_passes_nginx_t(nginx_binary, tmp_path):
    assert "test is successful" in Nginx(tmp_path, ["127.0.0.1:1"]).check_config()


def test_a_session_path_always_reaches_one_backend(pair):
    proxy, _, recorder = pair
    owner = {}
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        for _ in range(24):
            sid = _sid()
            paths = [f"/sessions/{sid}", f"/sessions/{sid}/messages", f"/sessions/{sid}/messages"]
            answers = {http.get(path).text for path in paths}
            # The header never overrides the path.
            other = {"X-Session-Id": _sid()}
            answers.add(http.post(f"/sessions/{sid}/messages", headers=other).text)
            assert len(answers) == 1, answers
            owner[sid] = answers.pop()
    assert set(owner.values()) == {"a", "b"}  # the ring spreads sessions over both
    assert recorder.where("GET", f"/sessions/{sid}") == [owner[sid]]


def test_the_session_header_steers_the_openai_api(pair):
    proxy, _, _ = pair
    homes = set()
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        for _ in range(24):
            headers = {"X-Session-Id": _sid()}
            answers = {http.post("/v1/chat/completions", headers=headers).text for _ in range(3)}
            assert len(answers) == 1
            homes |= answers
    assert homes == {"a", "b"}
    # The access log names the hash key and the one backend that served it.
    key = headers["X-Session-Id"]
    entries = proxy.wait_for_entries(lambda es: sum(e.key == key for e in es) >= 3)
    assert len({e.upstream for e in entries if e.key == key}) == 1


def test_requests_without_a_session_go_round_robin(pair):
    proxy, _, _ = pair
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        answers = [http.get("/v1/models").text for _ in range(6)]
    assert set(answers) == {"a", "b"}


def test_removing_a_backend_moves_only_its_own_sessions(nginx_binary, tmp_path):
    recorder = Recorder()
    backends = [Backend(name, recorder) for name in "abc"]
    sids = [_sid() for _ in range(40)]
    try:

        def homes(addresses: list[str], work) -> dict[str, str]:
            with Nginx(work, addresses) as proxy, httpx.Client(base_url=proxy.url) as http:
                return {sid: http.get(f"/sessions/{sid}").text for sid in sids}

        before = homes([b.address for b in backends], tmp_path / "three")
        after = homes([b.address for b in backends[:2]], tmp_path / "two")
    finally:
        for backend in backends:
            backend.stop()
    assert set(before.values()) == {"a", "b", "c"}
    assert all(after[sid] == home for sid, home in before.items() if home != "c")
    assert {after[sid] for sid, home in before.items() if home == "c"} <= {"a", "b"}


def test_a_refused_connect_moves_even_a_post_to_the_live_backend(nginx_binary, tmp_path):
    recorder = Recorder()
    live = Backend("live", recorder)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    try:
        with Nginx(tmp_path, [live.address, dead]) as proxy:
            with httpx.Client(base_url=proxy.url, timeout=30) as http:
                sids = [_sid() for _ in range(16)]
                answers = [http.post(f"/sessions/{sid}/messages").text for sid in sids]
            # The dead backend's share of the ring was tried, refused, and moved on.
            entries = proxy.wait_for_entries(lambda es: len(es) >= len(sids))
    finally:
        live.stop()
    assert answers == ["live"] * len(sids)
    assert any(dead in e.upstreams for e in entries)
    assert [h.path for h in recorder.hits].count(f"/sessions/{sids[0]}/messages") == 1


def test_a_dropped_request_is_retried_only_when_idempotent(nginx_binary, tmp_path):
    recorder = Recorder()
    backends = [Backend("a", recorder), Backend("b", recorder)]
    try:
        # max_fails=0: a drop must not take a backend out of the ring here, or
        # the second request would find one backend only and prove nothing.
        with Nginx(tmp_path, [b.address for b in backends], health="max_fails=0") as proxy:
            with httpx.Client(base_url=proxy.url, timeout=30) as http:
                get = http.get("/die-once")
                post = http.post("/die-once", json={"content": "hi"})
    finally:
        for backend in backends:
            backend.stop()
    # GET: the first backend dropped it, nginx asked the other, which answered.
    first, second = recorder.where("GET", "/die-once")
    assert first != second and get.status_code == 200 and get.text == second
    # POST: sent once and never again (a turn must not run twice); a clear 502.
    assert len(recorder.where("POST", "/die-once")) == 1
    assert post.status_code == 502
    assert post.headers["content-type"] == "application/json"
    assert post.json()["error"]["type"] == "replica_unavailable"
    assert post.headers["retry-after"] == "1"


def test_streams_pass_through_unbuffered(pair):
    proxy, backends, _ = pair
    for backend in backends:
        backend.release.clear()
    with httpx.Client(base_url=proxy.url, timeout=60) as http:
        with http.stream("GET", "/stream") as response:
            lines = response.iter_lines()
            # The backend holds its second chunk until we saw the first: a
            # buffering proxy would deliver nothing and this read would time out.
            assert next(line for line in lines if line) == "data: first"
            for backend in backends:
                backend.release.set()
            assert next(line for line in lines if line) == "data: second"


def test_a_stream_cut_by_its_backend_reaches_the_client_as_cut(pair):
    proxy, _, _ = pair
    with httpx.Client(base_url=proxy.url, timeout=60) as http:
        with http.stream("GET", "/stream-die") as response:
            assert response.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                for _ in response.iter_lines():
                    pass


@pytest.mark.parametrize(
    "path", ["/admin/cache", "/admin/system-prompts", "/admin", "/metrics", "/metrics?x=1"]
)
def test_admin_and_metrics_are_not_served_on_the_public_port(pair, path):
    proxy, _, recorder = pair
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        response = http.get(path, headers={"Authorization": "Bearer an-admin-key"})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
    assert recorder.where("GET", path) == []  # no replica saw it, nor the key
    # Other paths that merely start alike still reach a replica.
    with httpx.Client(base_url=proxy.url, timeout=30) as http:
        assert http.get("/administrators").status_code == 200
