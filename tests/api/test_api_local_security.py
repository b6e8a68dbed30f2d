"""Local mode (no API keys) cannot be driven by a web page, on the real service.

A page in the user's browser can send a "simple" cross-site POST (a form, or a
fetch with a text/plain or untyped body) without a CORS preflight, and with DNS
rebinding it can read a loopback server's answers under its own name. The
service refuses both: a foreign Host header is a 400, a POST not labelled
application/json a 415, and neither changes anything in Redis. The server names
one frontend origin (``CHATSVC_CORS_ORIGINS``): that origin's pages may call it,
and every refusal above still holds for every other page. The docs' own curl
commands must keep working against such a server.
"""

from __future__ import annotations

import json
import re
import select
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from bench.live_server import ThreadServer
from chatsvc.config import Limits, Settings
from tests.api.conftest import engine_config
from tests.http_helpers import keyspace
from tests.redis_server import unique_prefix

REPO = Path(__file__).resolve().parents[2]
# Short, so that a body trickled in one byte at a time runs out of it quickly.
BODY_DEADLINE_S = 2
LIMITS = Limits(max_tokens_cap=32, body_read_timeout_s=BODY_DEADLINE_S)
FOREIGN_HOSTS = [
    "attacker.example",
    "attacker.example:{port}",
    "127.0.0.1.attacker.example:{port}",
    "localhost.attacker.example",
]
# The one origin whose pages may call the server from a browser.
FRONTEND = "http://localhost:3000"


@pytest.fixture(scope="module")
def local(redis_server, tmp_path_factory):
    prefix = unique_prefix("local")
    settings = Settings(
        redis_url=redis_server.url,
        key_prefix=prefix,
        data_dir=tmp_path_factory.mktemp("local-data"),
        limits=LIMITS,
        cors_origins=(FRONTEND,),
        engine=engine_config(),
    )
    assert not settings.auth_enabled
    from chatsvc.api.app import create_app

    with ThreadServer(create_app(settings)) as server:
        server.prefix = prefix
        yield server


@pytest.fixture
def http(local):
    with httpx.Client(base_url=local.url, timeout=300) as client:
        yield client


def _session_ids(http: httpx.Client) -> set[str]:
    response = http.get("/sessions", params={"limit": 200})
    assert response.status_code == 200, response.text
    return {session["id"] for session in response.json()["sessions"]}


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
def test_a_rebinding_host_is_refused_and_changes_nothing(local, http, raw_redis, host):
    host = host.format(port=local.port)
    before = keyspace(raw_redis, local.prefix)
    headers = {"Host": host}
    reads = [http.get(path, headers=headers) for path in ("/sessions", "/admin/cache", "/readyz")]
    write = http.post("/sessions", json={"system_prompt": "rebound"}, headers=headers)
    for response in [*reads, write]:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_host"
        assert "sessions" not in response.text
    assert keyspace(raw_redis, local.prefix) == before


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:{port}", "127.0.0.1:{port}", "[::1]"])
def test_loopback_names_with_any_port_are_served(local, http, host):
    response = http.get("/sessions", headers={"Host": host.format(port=local.port)})
    assert response.status_code == 200, response.text


def test_a_request_without_host_is_refused(local):
    with socket.create_connection(("127.0.0.1", local.port), timeout=60) as sock:
        sock.sendall(b"GET /sessions HTTP/1.0\r\n\r\n")
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert b"invalid_host" in answer


CROSS_SITE_BODIES = [
    # (Content-Type a page can send without a preflight, body)
    ("application/x-www-form-urlencoded", b'{"system_prompt": "csrf"}'),
    (
        "multipart/form-data; boundary=b",
        b'--b\r\nContent-Disposition: form-data; name="x"\r\n\r\n{}',
    ),
    ("text/plain;charset=UTF-8", b'{"system_prompt": "csrf"}'),
    (None, b'{"system_prompt": "csrf"}'),  # fetch() of a Blob without a type
]


@pytest.mark.parametrize(("content_type", "body"), CROSS_SITE_BODIES)
def test_a_cross_site_form_post_creates_nothing(local, http, raw_redis, content_type, body):
    session = http.post("/sessions", json={}).json()["id"]
    history = http.get(f"/sessions/{session}/messages").json()
    sessions = _session_ids(http)
    before = keyspace(raw_redis, local.prefix)
    headers = {} if content_type is None else {"Content-Type": content_type}
    turn = body.replace(b'"system_prompt": "csrf"', b'"content": "Hi", "max_tokens": 2')
    for path, payload in (("/sessions", body), (f"/sessions/{session}/messages", turn)):
        response = http.post(path, content=payload, headers=headers)
        assert response.status_code == 415, response.text
        assert response.json()["error"]["type"] == "unsupported_media_type"
    assert keyspace(raw_redis, local.prefix) == before
    assert _session_ids(http) == sessions
    assert http.get(f"/sessions/{session}/messages").json() == history


def _preflight(http: httpx.Client, origin: str) -> httpx.Response:
    return http.options(
        "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization",
        },
    )


def test_the_named_frontend_may_call_from_a_browser_and_no_other_page(local, http, raw_redis):
    granted = _preflight(http, FRONTEND)
    assert granted.status_code == 204
    assert granted.headers["access-control-allow-origin"] == FRONTEND
    assert "POST" in granted.headers["access-control-allow-methods"]
    assert {"content-type", "authorization"} <= {
        h.strip() for h in granted.headers["access-control-allow-headers"].split(",")
    }
    assert "access-control-allow-credentials" not in granted.headers
    for origin in ("http://attacker.example", "http://localhost:3001", "null", FRONTEND + ".evil"):
        refused = _preflight(http, origin)
        assert refused.status_code == 400
        assert "access-control-allow-origin" not in refused.headers

    # The frontend's fetch: served, and its answer readable by the page (with its ids).
    created = http.post("/sessions", json={"system_prompt": "cors"}, headers={"Origin": FRONTEND})
    assert created.status_code == 201, created.text
    assert created.headers["access-control-allow-origin"] == FRONTEND
    exposed = created.headers["access-control-expose-headers"].lower()
    assert "x-request-id" in exposed and "x-prompt-cache-key" in exposed
    # An error is readable too, so the page can show why.
    form = http.post("/sessions", content=b"{}", headers={"Origin": FRONTEND})
    assert form.status_code == 415
    assert form.headers["access-control-allow-origin"] == FRONTEND
    # Another page's answer carries no grant, so its browser keeps it from the page;
    # and it cannot send JSON at all (its preflight was refused above).
    before = keyspace(raw_redis, local.prefix)
    other = http.post("/sessions", content=b"{}", headers={"Origin": "http://attacker.example"})
    assert other.status_code == 415
    assert "access-control-allow-origin" not in other.headers
    assert keyspace(raw_redis, local.prefix) == before


def _read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_body_trickled_byte_by_byte_runs_out_of_its_deadline(local, http, raw_redis):
    # Each byte comes well inside the deadline, so a deadline per chunk never fired
    # and the session below was created once the last byte arrived.
    body = b'{"system_prompt": "' + b"s" * 400 + b'"}'
    sessions = _session_ids(http)
    before = keyspace(raw_redis, local.prefix)
    head = (
        f"POST /sessions HTTP/1.1\r\nHost: 127.0.0.1:{local.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", local.port), timeout=120) as sock:
        sock.sendall(head)
        for byte in body:
            # A pause of a twentieth of the deadline; the answer ends the trickle.
            if select.select([sock], [], [], BODY_DEADLINE_S / 20)[0]:
                break
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # the server closed first
                break
        # Bytes sent as the server answered are read and dropped by its lingering close
        # (chatsvc.api.http_server), so the answer arrives whole, never a reset.
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"request_timeout" in answer
    assert keyspace(raw_redis, local.prefix) == before
    assert _session_ids(http) == sessions


def _doc_curl_commands(path: Path) -> list[str]:
    """Every curl command of a doc's code blocks (continued while a quote is open)."""
    commands, current = [], None
    for line in path.read_text().splitlines():
        text = line.strip()
        if current is not None:
            current.append(text)
        elif re.match(r"^(\w+=\$\()?curl\s", text):
            current = [text]
        else:
            continue
        joined = "\n".join(current)
        if joined.count("'") % 2 == 0:
            commands.append(joined)
            current = None
    return commands


DOC_COMMANDS = [
    (doc.name, command)
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for command in _doc_curl_commands(doc)
]


def _run_shell(script: str, env: dict[str, str]) -> str:
    # --fail-with-body: an HTTP error answer makes curl exit non-zero.
    prelude = 'set -eo pipefail\ncurl() { command curl --fail-with-body "$@"; }\n'
    done = subprocess.run(
        ["bash", "-c", prelude + script],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{script}\nstdout: {done.stdout}\nstderr: {done.stderr}"
    return done.stdout


def test_the_docs_have_curl_examples():
    names = {name for name, _ in DOC_COMMANDS}
    assert {"README.md", "api.md"} <= names
    assert len(DOC_COMMANDS) >= 12


# README's commands are one conversation: test_the_readme_conversation_... runs them.
DOCS_ONLY = [(name, command) for name, command in DOC_COMMANDS if name != "README.md"]


@pytest.mark.parametrize(
    "command", [c for _, c in DOCS_ONLY], ids=[f"{n}:{i}" for i, (n, _) in enumerate(DOCS_ONLY)]
)
def test_every_doc_curl_command_works_on_a_local_server(local, http, command):
    prompt = http.post("/system-prompts", json={"name": "doc", "text": "You are a doc."}).json()
    env = {
        "PATH": "/usr/bin:/bin",
        "URL": local.url,
        # Local mode ignores keys; the commands must work with them sent all the same.
        "KEY": "my-tenant-key",
        "ADMIN": "my-admin-key",
        "H": "Authorization: Bearer my-tenant-key",
        "J": "Content-Type: application/json",
        "SID": http.post("/sessions", json={}).json()["id"],
    }
    if '"regenerate"' in command:  # regenerating needs an answer to replace
        turn = {"content": "Hi", "max_tokens": 2, "temperature": 0}
        assert http.post(f"/sessions/{env['SID']}/messages", json=turn).status_code == 200
    if "/admin/system-prompts" in command:  # the operator's routes act on shared prompts
        body = {"name": "doc", "text": "You are a shared doc."}
        prompt = http.post("/admin/system-prompts", json=body).json()
    script = command.replace("localhost:8000", f"localhost:{local.port}")
    script = script.replace("<id>", prompt["id"])
    _run_shell(script, env)


def test_the_readme_conversation_works_and_reuses_the_cache(local):
    readme = [c for name, c in DOC_COMMANDS if name == "README.md"]
    assert readme[0].startswith("SID=$(curl")
    script = "\n".join(readme).replace("localhost:8000", f"localhost:{local.port}")
    out = _run_shell(script, {"PATH": "/usr/bin:/bin"})
    answers, decoder, at = [], json.JSONDecoder(), 0
    while at < len(out.strip()):  # curl prints the answers back to back, no newline
        answer, at = decoder.raw_decode(out, at)
        answers.append(answer)
    assert len(answers) == 2 and all(answer["message"]["content"] for answer in answers)
    assert answers[1]["usage"]["cached_tokens"] > 0
