"""SIGKILL while the disk KV tier is busy writing, then a restart.

``python -m chatsvc serve`` (fp32, its own Redis with the AOF fsynced on every
write, its disk tier in a temporary directory) holds several conversations;
it is killed the moment a round of long prompts has been prefilled (their
blocks' writes just queued). After the restart, the disk index comes back
from the files, every conversation continues with the greedy tokens the same
model computes with no cache at all, and no block fails its check.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from bench.live_server import ProcessServer, wait_until
from cache import Namespace
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine
from chatsvc.protocol import GenerationRequest, SamplingParams
from chatsvc.store import Store
from chatsvc.store.embedded import EmbeddedRedis
from tests.redis_server import unique_prefix

pytestmark = pytest.mark.slow
KEY = "kv-crash-tenant-key-01"
ADMIN = "kv-crash-admin-key-02"
MAX_TOKENS = 12
TOPICS = ["the Danube", "the Rhine", "the Loire"]


@pytest.fixture(scope="module")
def redis_aof(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("aof"), appendfsync="always") as server:
        yield server


@pytest.fixture(scope="module")
def smollm2_fp32():
    from chatsvc.engine.loader import load_model

    return load_model("smollm2", dtype="fp32")


@pytest.fixture(scope="module")
def prefix() -> str:
    return unique_prefix("kvcrash")


@pytest.fixture(scope="module")
def service(redis_aof, prefix, tmp_path_factory):
    work = tmp_path_factory.mktemp("kvcrash")
    env = {
        "CHATSVC_REDIS_URL": redis_aof.url,
        "CHATSVC_KEY_PREFIX": prefix,
        "CHATSVC_API_KEYS": f"acme:{KEY}",
        "CHATSVC_ADMIN_KEY": ADMIN,
        "CHATSVC_DTYPE": "fp32",
        "CHATSVC_NUM_GPU_BLOCKS": "256",
        "CHATSVC_MAX_MODEL_LEN": "1024",
        "CHATSVC_MAX_TOKENS_CAP": "64",
        "CHATSVC_KV_DISK_DIR": str(work / "kv"),
        # The killed process's turn locks expire soon after the restart.
        "CHATSVC_TURN_LOCK_TTL_S": "2",
    }
    server = ProcessServer(env, work / "chatsvc.log")
    server.start()
    yield server
    server.stop()


def _http(server, key=KEY) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=600
    )


def _turn(server, http, sid, text) -> dict:
    body = {"content": text, "max_tokens": MAX_TOKENS, "temperature": 0}
    holder = {}

    def answered() -> bool:
        # 409 while a lock the killed process held has not expired yet.
        holder["response"] = http.post(f"/sessions/{sid}/messages", json=body)
        return holder["response"].status_code != 409

    wait_until(answered, 120, "the killed process's turn lock to expire")
    response = holder["response"]
    # A stalled engine is stopped by its watchdog (503): its stacks are in the log.
    assert response.status_code == 200, (response.text, server.log_tail())
    return response.json()


def _long_question(topic: str, turn: int) -> str:
    return (
        f"Question {turn} about {topic}: describe its source, the countries it crosses, "
        "the cities on its banks, its bridges, its history as a trade route, and what a "
        "traveller should see along it, in order, from the source to the sea. " * 2
    )


def _stream_until_first_delta(server, sid: str, text: str, first: threading.Event) -> None:
    body = {"content": text, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    try:
        with (
            _http(server) as http,
            http.stream("POST", f"/sessions/{sid}/messages", json=body) as response,
        ):
            for line in response.iter_lines():
                if line.startswith("event: delta"):
                    first.set()
    except httpx.HTTPError:
        pass  # the server was killed under it
    finally:
        first.set()


async def _conversation(url: str, prefix: str, sid: str):
    store = await Store.connect(url, prefix=prefix)
    try:
        tenant = await store.tenants.by_name("acme")
        session = await store.sessions.get(tenant.id, sid)
        messages = await store.tree.messages(tenant.id, sid)
        return list(session.token_ids), messages
    finally:
        await store.close()


def test_sigkill_during_disk_writes_serves_no_bad_block_after_restart(
    service, redis_aof, prefix, smollm2_fp32
):
    with _http(service) as http:
        sids = [http.post("/sessions", json={}).json()["id"] for _ in TOPICS]
        for sid, topic in zip(sids, TOPICS, strict=True):
            _turn(service, http, sid, _long_question(topic, 1))
    # A round of long prompts at once; kill as soon as one has been prefilled.
    first = threading.Event()
    threads = [
        threading.Thread(
            target=_stream_until_first_delta,
            args=(service, sid, _long_question(topic, 2), first),
            daemon=True,
        )
        for sid, topic in zip(sids, TOPICS, strict=True)
    ]
    for thread in threads:
        thread.start()
    first.wait(600)
    service.kill()
    for thread in threads:
        thread.join(60)
    kv_dir = service.env["CHATSVC_KV_DISK_DIR"]
    service.start()

    with _http(service, ADMIN) as admin:
        disk = admin.get("/admin/cache").json()["engine"]["disk"]
    assert disk["blocks"] > 0 and disk["dir"].startswith(kv_dir)  # the index came back

    reference = LLMEngine(
        EngineConfig(dtype="fp32", num_gpu_blocks=256, enable_prefix_cache=False),
        loaded=smollm2_fp32,
    )
    disk_hits = 0
    with _http(service) as http:
        for sid, topic in zip(sids, TOPICS, strict=True):
            answer = _turn(service, http, sid, _long_question(topic, 3))
            disk_hits += answer["usage"]["cached_tokens_by_tier"]["disk"]
            tokens, messages = asyncio.run(_conversation(redis_aof.url, prefix, sid))
            produced = messages[-1].token_ids
            prompt = tokens[: len(tokens) - len(produced)]
            expected = _greedy(reference, sid, prompt)
            assert produced == expected, (sid, produced, expected)
    assert disk_hits > 0  # the first turn after the restart reused the files
    with _http(service, ADMIN) as admin:
        disk = admin.get("/admin/cache").json()["engine"]["disk"]
    assert disk["dropped_blocks"]["corrupt"] == 0 and disk["dropped_blocks"]["foreign"] == 0
    assert disk["loaded_blocks"] > 0


def _greedy(engine: LLMEngine, request_id: str, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    engine.add_request(GenerationRequest(request_id, prompt, params, Namespace(b"ref")))
    tokens: list[int] = []
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None, out.error
            tokens += out.delta.token_ids
    return tokens
