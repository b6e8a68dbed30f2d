"""Logs: no conversation text by default, and a request id on every line of a request."""

from __future__ import annotations

import io
import logging
import uuid

import pytest

from chatsvc.config import Settings, SettingsError
from chatsvc.logs import (
    LOG_FORMAT,
    NO_REQUEST,
    RequestIdFilter,
    configure_logging,
    request_id_from,
    text_for_log,
)
from tests.reliability.conftest import new_session


@pytest.fixture
def captured_logs():
    """Every record the process logs at DEBUG and up, formatted as the service formats it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    records: list[logging.LogRecord] = []
    collector = logging.Handler()
    collector.addFilter(RequestIdFilter())
    collector.emit = records.append
    root = logging.getLogger()
    old_level = root.level
    root.setLevel(logging.DEBUG)
    root.addHandler(handler)
    root.addHandler(collector)
    try:
        yield stream, records
    finally:
        root.removeHandler(handler)
        root.removeHandler(collector)
        root.setLevel(old_level)


def _service_records(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    # The test's own client (httpx) logs too; only the service's lines count.
    return [r for r in records if r.name.startswith(("chatsvc", "uvicorn", "litestar"))]


def test_a_turn_logs_no_text_and_tags_every_line(acme, captured_logs):
    stream, records = captured_logs
    marker = f"zebra-{uuid.uuid4().hex}"
    sid = new_session(acme, system_prompt=f"System {marker}")["id"]
    rid = f"test-{uuid.uuid4().hex[:12]}"
    response = acme.post(
        f"/sessions/{sid}/messages",
        json={"content": f"Repeat {marker} please", "max_tokens": 8, "temperature": 0},
        headers={"X-Request-ID": rid},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == rid
    stored = [r for r in _service_records(records) if r.getMessage().startswith("turn stored")]
    assert len(stored) == 1 and stored[0].request_id == rid
    assert marker not in stream.getvalue()
    answer = response.json()["message"]["content"]
    assert not answer.strip() or answer not in stream.getvalue().replace(marker, "")


def test_every_request_gets_an_id_and_insane_ones_are_replaced(acme):
    first = acme.get("/sessions").headers["x-request-id"]
    second = acme.get("/sessions").headers["x-request-id"]
    assert first != second and len(first) == 32
    forged = "x" * 65
    replaced = acme.get("/sessions", headers={"X-Request-ID": forged}).headers["x-request-id"]
    assert replaced != forged and len(replaced) == 32
    assert request_id_from("a b") != "a b"
    assert request_id_from("line\nbreak") != "line\nbreak"
    assert request_id_from("req-1.2:3_x") == "req-1.2:3_x"


def test_error_answers_carry_the_request_id(acme):
    response = acme.get("/sessions/nope", headers={"X-Request-ID": "err-42"})
    assert response.status_code == 404
    assert response.headers["x-request-id"] == "err-42"


def test_lines_outside_a_request_say_so():
    record = logging.LogRecord("chatsvc.x", logging.INFO, __file__, 1, "start-up", None, None)
    RequestIdFilter().filter(record)
    assert record.request_id == NO_REQUEST


def test_text_logging_is_opt_in():
    try:
        configure_logging("WARNING")
        assert text_for_log("secret words") == "<12 chars>"
        configure_logging("WARNING", log_text=True)
        assert text_for_log("secret words") == "'secret words'"
    finally:
        configure_logging("WARNING")
        root = logging.getLogger()
        for handler in [h for h in root.handlers if getattr(h, "_chatsvc", False)]:
            root.removeHandler(handler)
    assert Settings.from_env({"CHATSVC_LOG_TEXT": "1"}).log_text is True
    assert Settings.from_env({}).log_text is False
    with pytest.raises(SettingsError, match="LOG_TEXT"):
        Settings.from_env({"CHATSVC_LOG_TEXT": "maybe"})
