"""The terminal chat client against the live server."""

from __future__ import annotations

import io

from chatsvc.chat_client import ChatClient, iter_sse, run
from tests.api.conftest import ACME_KEY


def test_iter_sse_parses_events_and_multiline_data():
    lines = ["event: delta", "data: a", "data: b", "", ": comment", "data: plain", ""]
    assert list(iter_sse(iter(lines))) == [("delta", "a\nb"), ("message", "plain")]


def test_chat_loop_streams_answers_and_shows_history(api):
    client = ChatClient(api.url, api_key=ACME_KEY)
    stdin = io.StringIO("Say hi.\n/history\n/quit\n")
    stdout = io.StringIO()
    try:
        assert run(client, None, "Be brief.", stdin=stdin, stdout=stdout, max_tokens=6) == 0
    finally:
        client.close()
    out = stdout.getvalue()
    assert out.startswith("session ")
    assert "prompt tokens cached" in out
    assert "[system] Be brief." in out and "[user] Say hi." in out and "[assistant] " in out
