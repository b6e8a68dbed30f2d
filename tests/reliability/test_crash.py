"""Crash safety, short form of ``python -m bench.reliability.crash_loop``: 3 SIGKILLs mid-stream.

The service runs as a child process on one embedded Redis (AOF, fsync always)
that outlives it. After every kill Redis is checked against what the clients
saw: every acknowledged turn (a ``done`` event) is stored word for word, each
session's messages are user/assistant pairs whose token ids concatenate to the
session's token history, and after the last restart every conversation takes
one more turn.
"""

from __future__ import annotations

import pytest

from bench.reliability.crash_loop import parse_args, run

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def test_three_kills_mid_stream_lose_no_acknowledged_turn(tmp_path):
    args = parse_args(["--kills", "3", "--conversations", "3", "--seed", "7"])
    report = await run(args, tmp_path)
    print(report.summary())
    assert report.problems == []
    assert report.kills == 3
    # The kills really landed mid-generation, and the loop did real work around them.
    assert sum(report.streams_mid_generation_at_kill) >= 3
    assert report.acknowledged >= 3  # 3 final turns at least, each checked in Redis
    assert report.sessions >= 3
