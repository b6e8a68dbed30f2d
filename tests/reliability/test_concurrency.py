"""Concurrency: racing clients on one session, and clients that cut
their streams at random points.

Every client here has its own ``httpx.Client`` (its own connection), started
from a barrier in its own thread, so the server really sees them at once.
"""

from __future__ import annotations

import json
import random
import socket
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from bench.live_server import wait_until
from tests.reliability.conftest import (
    ACME_KEY,
    ADMIN_KEY,
    GLOBEX_KEY,
    RELIABILITY_LIMITS,
    cache_idle_report,
    client,
    new_session,
    say,
    session_problems,
    unique,
)

NUM_RACERS = 12
# A prompt that keeps the model talking past the 32-token cap: the winner's turn
# must outlast the arrival of every racer for "exactly one 200" to be the rule.
LONG_ANSWER = "Count from 1 to 200, one number per line."


def _tenant_id(server, key: str) -> str:
    return server.services.tenants.tenant_for_key(key).id


def _wait_idle(server, tenant_id: str) -> None:
    """Wait until the server has noticed every cut stream: no generation slot held,
    no sequence in the engine (readiness wait; the bound is generous on purpose)."""

    def idle() -> bool:
        if server.services.streams.active(tenant_id):
            return False
        with client(server, ADMIN_KEY) as admin:
            return cache_idle_report(admin)["engine"]["num_sequences"] == 0

    wait_until(idle, 120, "the cut streams to be released")


def _race(server, session_id: str, texts: list[str], streaming: list[bool]) -> list[dict]:
    """Post ``texts`` to one session at once, each from its own connection."""
    barrier = threading.Barrier(len(texts))

    def post(i: int) -> dict:
        body = {"content": texts[i], "max_tokens": 32, "temperature": 0, "stream": streaming[i]}
        with client(server, ACME_KEY) as http:
            http.get("/healthz")  # connect before the barrier, so all requests leave together
            barrier.wait()
            with http.stream("POST", f"/sessions/{session_id}/messages", json=body) as response:
                lines = list(response.iter_lines())
                return {"text": texts[i], "status": response.status_code, "lines": lines}

    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(post, range(len(texts))))


def test_racing_posts_get_one_turn_and_409s(server, acme):
    session_id = new_session(acme)["id"]
    for round_no in range(2):
        before = acme.get(f"/sessions/{session_id}/messages").json()["messages"]
        texts = [unique(f"{LONG_ANSWER} (client {i})") for i in range(NUM_RACERS)]
        # Half of the racers stream: a 409 must come before any stream starts.
        answers = _race(server, session_id, texts, [i % 2 == 0 for i in range(NUM_RACERS)])

        statuses = Counter(a["status"] for a in answers)
        assert statuses == {200: 1, 409: NUM_RACERS - 1}, (round_no, statuses)
        for loser in (a for a in answers if a["status"] == 409):
            assert '"session_busy"' in "".join(loser["lines"]), loser
        winner = next(a for a in answers if a["status"] == 200)

        after = acme.get(f"/sessions/{session_id}/messages").json()["messages"]
        assert after[: len(before)] == before
        new = after[len(before) :]
        assert [m["role"] for m in new] == ["user", "assistant"], new
        assert new[0]["content"] == winner["text"]
        if "event: done" in winner["lines"]:
            done = winner["lines"][winner["lines"].index("event: done") + 1]
            # The event's JSON, not its text: an answer with a newline is escaped there.
            assert (
                json.loads(done.removeprefix("data: "))["message"]["content"] == new[1]["content"]
            )
        roles = [m["role"] for m in after if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
    assert session_problems(server, ACME_KEY) == []


def _cut_stream(server, session_id: str, events_before_cut: int) -> dict:
    """Stream a turn and disconnect after ``events_before_cut`` SSE events
    (0: right after the response headers); report what the client saw."""
    body = {"content": unique(LONG_ANSWER), "max_tokens": 32, "temperature": 0, "stream": True}
    seen: list[str] = []
    with client(server, GLOBEX_KEY) as http:
        with http.stream("POST", f"/sessions/{session_id}/messages", json=body) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if len(seen) >= events_before_cut:
                    break
                if line.startswith("event: "):
                    seen.append(line.removeprefix("event: "))
        # Leaving the block closes a half-read response, which closes the connection.
    return {"session": session_id, "events": seen, "acked": "done" in seen}


def _gone_before_answer(server, session_id: str) -> dict:
    """Send a whole streaming request and hang up without reading a byte."""
    body = {"content": unique(LONG_ANSWER), "max_tokens": 32, "temperature": 0, "stream": True}
    payload = json.dumps(body).encode()
    request = (
        f"POST /sessions/{session_id}/messages HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {GLOBEX_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request)
    return {"session": session_id, "events": [], "acked": False}


def test_random_stream_cuts_leak_nothing(server, globex, admin):
    rng = random.Random(7)
    tenant = _tenant_id(server, GLOBEX_KEY)
    parallel = RELIABILITY_LIMITS.max_streams_per_tenant
    sessions = [new_session(globex)["id"] for _ in range(parallel)]
    cuts: list[dict] = []
    for round_no in range(9):
        # Every session of the round streams at once; each client hangs up at its own point.
        plan = []
        for sid in sessions:
            if round_no % 3 == 2 and sid == sessions[0]:
                plan.append(lambda sid=sid: _gone_before_answer(server, sid))
            else:
                after = rng.randint(0, 28)
                plan.append(lambda sid=sid, after=after: _cut_stream(server, sid, after))
        with ThreadPoolExecutor(len(plan)) as pool:
            cuts.extend(pool.map(lambda run: run(), plan))
        _wait_idle(server, tenant)

    disconnects = [c for c in cuts if not c["acked"]]
    print(
        f"\ncuts: {len(cuts)} streams, {len(disconnects)} cut before done; events before the "
        f"cut: {sorted(Counter(len(c['events']) for c in cuts).items())}"
    )
    assert len(disconnects) >= 20

    report = cache_idle_report(admin)
    assert report["integrity"] == "ok", report["integrity"]
    assert report["engine"]["num_sequences"] == 0
    assert report["engine"]["device"]["used"] == 0, report["engine"]["device"]
    device = report["engine"]["device"]
    assert device["free"] + device["cached"] == device["total"], device

    # Every acknowledged turn is stored; a cut one is stored whole or not at all.
    stored = 0
    for sid in sessions:
        messages = globex.get(f"/sessions/{sid}/messages").json()["messages"]
        pairs = [m for m in messages if m["role"] == "user"]
        acked = sum(c["acked"] for c in cuts if c["session"] == sid)
        tried = sum(c["session"] == sid for c in cuts)
        assert acked <= len(pairs) <= tried, (sid, acked, len(pairs), tried)
        stored += len(pairs)
    print(f"cuts: {stored} turns stored (acknowledged or committed just before the cut)")
    assert session_problems(server, GLOBEX_KEY) == []

    # And every conversation goes on.
    for sid in sessions:
        before = len(globex.get(f"/sessions/{sid}/messages").json()["messages"])
        say(globex, sid, unique("Thanks. One more word?"))
        assert len(globex.get(f"/sessions/{sid}/messages").json()["messages"]) == before + 2
    assert cache_idle_report(admin)["engine"]["device"]["used"] == 0
