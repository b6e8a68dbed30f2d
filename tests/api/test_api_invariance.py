"""Issue 26 end to end: the same answers with the prefix cache on and off.

Two services on one machine, both in bf16 (forced: ``CHATSVC_DTYPE=bf16`` runs on a CPU
without native bf16 too), one with the prefix cache and the disk tier, one without
either. Conversations go to both a turn at a time, every conversation's turn at once,
so each service batches them as its own timing falls; later turns find their history
in the first service's cache and are computed afresh by the second. Every greedy answer
must be byte-identical. Then the first service restarts on its data directory, finds
the histories in its disk tier, and the next turns must still match.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.live_server import ProcessServer
from chatsvc.store.embedded import EmbeddedRedis
from tests.redis_server import unique_prefix

KEY = "invariance-tenant-key-01"
CONVERSATIONS = [
    ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"],
    ["Name three primary colours.", "Mix the first two: what do you get?", "And all three?"],
    ["Write a haiku about rain.", "Now one about the sun.", "Which do you prefer?"],
    ["What is 12 times 7?", "Divide that by 4.", "Round it to the nearest ten."],
]


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


def _service(redis, tmp_path_factory, name: str, extra: dict[str, str]) -> ProcessServer:
    env = {
        "CHATSVC_REDIS_URL": redis.url,
        "CHATSVC_KEY_PREFIX": unique_prefix(name),
        "CHATSVC_API_KEYS": f"acme:{KEY}",
        "CHATSVC_HOST": "127.0.0.1",
        "CHATSVC_DTYPE": "bf16",
        "CHATSVC_NUM_GPU_BLOCKS": "256",
        "CHATSVC_MAX_MODEL_LEN": "1024",
        **extra,
    }
    return ProcessServer(env, tmp_path_factory.mktemp(name) / "chatsvc.log")


@pytest.fixture(scope="module")
def services(redis, tmp_path_factory):
    cached = _service(redis, tmp_path_factory, "cached", {})
    uncached = _service(
        redis,
        tmp_path_factory,
        "uncached",
        {"CHATSVC_ENABLE_PREFIX_CACHE": "0", "CHATSVC_KV_DISK_BYTES": "0"},
    )
    with ThreadPoolExecutor(2) as pool:  # both load their models at once
        list(pool.map(ProcessServer.start, (cached, uncached)))
    yield cached, uncached
    cached.stop()
    uncached.stop()


def _client(server: ProcessServer) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600
    )


def _round(server: ProcessServer, sessions: list[str], texts: list[str]) -> list[dict]:
    """One turn of every conversation, all at once."""

    def turn(pair: tuple[str, str]) -> dict:
        sid, text = pair
        with _client(server) as http:
            body = {"content": text, "max_tokens": 24, "temperature": 0}
            response = http.post(f"/sessions/{sid}/messages", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    with ThreadPoolExecutor(len(sessions)) as pool:
        return list(pool.map(turn, zip(sessions, texts, strict=True)))


def _open(server: ProcessServer) -> list[str]:
    with _client(server) as http:
        return [
            http.post("/sessions", json={"system_prompt": "You are brief."}).json()["id"]
            for _ in CONVERSATIONS
        ]


def test_answers_are_the_same_with_the_cache_on_and_off_and_after_a_restart(services):
    cached, uncached = services
    sessions = {cached: _open(cached), uncached: _open(uncached)}
    hits = 0
    for turn in range(len(CONVERSATIONS[0])):
        texts = [conversation[turn] for conversation in CONVERSATIONS]
        with ThreadPoolExecutor(2) as pool:
            on, off = pool.map(_round, (cached, uncached), sessions.values(), (texts, texts))
        assert [r["message"]["content"] for r in on] == [r["message"]["content"] for r in off]
        assert all(r["usage"]["cached_tokens"] == 0 for r in off)
        hits += sum(r["usage"]["cached_tokens"] for r in on)
    assert hits > 0  # the later turns did come from the cache

    cached.stop()  # a clean stop; the history's blocks are in the disk tier
    cached.start()
    last = ["Summarise our conversation in one sentence."] * len(CONVERSATIONS)
    with ThreadPoolExecutor(2) as pool:
        on, off = pool.map(_round, (cached, uncached), sessions.values(), (last, last))
    assert [r["message"]["content"] for r in on] == [r["message"]["content"] for r in off]
    from_disk = sum(r["usage"]["cached_tokens_by_tier"]["disk"] for r in on)
    assert from_disk > 0, [r["usage"] for r in on]
