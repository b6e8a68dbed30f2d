"""The request guards without the model: Host allow-list settings and parsing, and what a
store outage tells the caller (a real Litestar app with the service's error handlers)."""

from __future__ import annotations

import logging

import pytest
import redis.exceptions as rexc
from litestar import get, post
from litestar.params import JSONBody
from litestar.testing import create_test_client

from chatsvc.api.shared.content_type import json_only_middleware
from chatsvc.api.shared.errors import EXCEPTION_HANDLERS
from chatsvc.api.shared.host_check import allowed_hosts_middleware, host_name
from chatsvc.config import Settings, SettingsError
from chatsvc.store.connection import unavailable_on_failure

KEYS = "acme:acme-guards-key-0001"


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost", "localhost"),
        ("LocalHost:8000", "localhost"),
        ("127.0.0.1:1", "127.0.0.1"),
        ("[::1]:8000", "[::1]"),
        ("[0:0:0:0:0:0:0:1]", "[::1]"),
        ("attacker.example:8000", "attacker.example"),
        ("localhost:", "localhost"),
        ("localhost:80x", None),
        ("localhost:\u00b2", None),
        ("[::1", None),
        ("[::1]x", None),
        ("", None),
        (":8000", None),
    ],
)
def test_host_header_names_are_parsed_without_their_port(header, name):
    assert host_name(header) == name


def test_local_mode_serves_loopback_names_and_the_bind_host_by_default():
    assert Settings.from_env({}).host_allow_list() == {"localhost", "127.0.0.1", "[::1]"}
    bound = Settings.from_env({"CHATSVC_HOST": "127.0.0.2"}).host_allow_list()
    assert bound == {"localhost", "127.0.0.1", "[::1]", "127.0.0.2"}


def test_configured_names_replace_the_defaults():
    settings = Settings.from_env({"CHATSVC_ALLOWED_HOSTS": "Chat.Lan, ::1"})
    assert settings.allowed_hosts == ("Chat.Lan", "::1")
    assert settings.host_allow_list() == {"chat.lan", "[::1]", "127.0.0.1"}


def test_with_keys_any_host_is_served_unless_names_are_configured():
    assert Settings.from_env({"CHATSVC_API_KEYS": KEYS}).host_allow_list() is None
    named = Settings.from_env(
        {"CHATSVC_API_KEYS": KEYS, "CHATSVC_HOST": "0.0.0.0", "CHATSVC_ALLOWED_HOSTS": "chat.io"}
    )
    assert named.host_allow_list() == {"chat.io", "0.0.0.0"}
    anything = Settings.from_env({"CHATSVC_API_KEYS": KEYS, "CHATSVC_ALLOWED_HOSTS": "*"})
    assert anything.host_allow_list() is None


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"CHATSVC_ALLOWED_HOSTS": "*"}, "needs CHATSVC_API_KEYS"),
        ({"CHATSVC_ALLOWED_HOSTS": "localhost:8000"}, "without a port"),
        ({"CHATSVC_ALLOWED_HOSTS": "http://chat.lan"}, "not a host name"),
        ({"CHATSVC_ALLOWED_HOSTS": "*.chat.lan", "CHATSVC_API_KEYS": KEYS}, "not a host name"),
    ],
)
def test_bad_allowed_hosts_are_start_up_errors(env, match):
    with pytest.raises(SettingsError, match=match):
        Settings.from_env(env)


def test_cors_origins_are_read_as_browsers_write_them():
    settings = Settings.from_env(
        {"CHATSVC_CORS_ORIGINS": "http://LocalHost:3000, tauri://localhost, https://*.chat.lan"}
    )
    assert settings.cors_allow_list() == [
        "http://localhost:3000",
        "tauri://localhost",
        "https://*.chat.lan",
    ]
    assert Settings.from_env({}).cors_allow_list() == []
    anything = Settings.from_env({"CHATSVC_API_KEYS": KEYS, "CHATSVC_CORS_ORIGINS": "*"})
    assert anything.cors_allow_list() == ["*"]


@pytest.mark.parametrize(
    ("origins", "match"),
    [
        ("*", "needs CHATSVC_API_KEYS"),
        ("localhost:3000", "not an origin"),
        ("http://localhost:3000/", "not an origin"),
        ("http://localhost:3000/app", "not an origin"),
        ("null", "not an origin"),
    ],
)
def test_bad_cors_origins_are_start_up_errors(origins, match):
    with pytest.raises(SettingsError, match=match):
        Settings.from_env({"CHATSVC_CORS_ORIGINS": origins})


def _preflight_to(app, origin: str):
    from litestar.testing import TestClient

    # No lifespan: a preflight is answered before the service is even started.
    client = TestClient(app)
    return client.options(
        "/v1/chat/completions",
        headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
    )


def test_no_origin_is_granted_unless_one_is_named():
    from chatsvc.api.app import create_app

    default = _preflight_to(create_app(Settings.from_env({})), "http://localhost:3000")
    assert "access-control-allow-origin" not in default.headers
    named = create_app(Settings.from_env({"CHATSVC_CORS_ORIGINS": "https://*.chat.lan"}))
    granted = _preflight_to(named, "https://team.chat.lan")
    assert granted.headers["access-control-allow-origin"] == "https://team.chat.lan"
    for origin in ("https://chat.lan", "https://team.chat.lan.evil", "http://team.chat.lan"):
        assert "access-control-allow-origin" not in _preflight_to(named, origin).headers


@get("/ping", sync_to_thread=False)
def _ping() -> dict[str, str]:
    return {"ok": "yes"}


@post("/echo", sync_to_thread=False)
def _echo(data: JSONBody[dict[str, str]]) -> dict[str, str]:
    return data


def _guarded_client(allowed):
    return create_test_client(
        [_ping, _echo],
        middleware=[allowed_hosts_middleware(allowed), json_only_middleware],
        exception_handlers=EXCEPTION_HANDLERS,
    )


def test_a_foreign_host_is_refused_with_the_error_shape():
    with _guarded_client(frozenset({"localhost"})) as client:
        assert client.get("/ping", headers={"Host": "localhost:9"}).status_code == 200
        refused = client.get("/ping", headers={"Host": "attacker.example"})
        assert refused.status_code == 400
        assert refused.json()["error"]["type"] == "invalid_host"
        # The test client's own default name is not on the list either.
        assert client.get("/ping").status_code == 400
    with _guarded_client(None) as client:
        assert client.get("/ping", headers={"Host": "attacker.example"}).status_code == 200


@pytest.mark.parametrize(
    "content_type",
    [None, "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/plain"],
)
def test_only_json_bodies_are_accepted(content_type):
    headers = {"Host": "localhost"} | (
        {} if content_type is None else {"Content-Type": content_type}
    )
    with _guarded_client(frozenset({"localhost"})) as client:
        refused = client.post("/echo", content=b'{"a": "b"}', headers=headers)
        assert refused.status_code == 415
        assert refused.json()["error"]["type"] == "unsupported_media_type"
        headers["Content-Type"] = "application/json; charset=utf-8"
        assert client.post("/echo", content=b'{"a": "b"}', headers=headers).json() == {"a": "b"}


@get("/outage", sync_to_thread=False)
def _outage() -> None:
    with unavailable_on_failure("redis://:s3cret@redis-7.internal:6390/0?password=s3cret"):
        raise rexc.ConnectionError("Error 111 connecting to redis-7.internal:6390. Refused.")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_store_outage_names_no_server_to_the_caller_and_logs_the_detail():
    # A handler of our own: the test app's logging setup may stop propagation.
    records = _Records()
    logger = logging.getLogger("chatsvc.api.shared.errors")
    logger.addHandler(records)
    try:
        with create_test_client([_outage], exception_handlers=EXCEPTION_HANDLERS) as client:
            response = client.get("/outage")
    finally:
        logger.removeHandler(records)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "store_unavailable" and "unavailable" in error["message"]
    for detail in ("redis-7", "6390", "redis://", "ConnectionError", "111", "s3cret"):
        assert detail not in response.text
    logged = "\n".join(record.getMessage() for record in records.records)
    assert "redis-7.internal:6390" in logged and "s3cret" not in logged
