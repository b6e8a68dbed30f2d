"""The disk KV tier through the HTTP API: per-tier usage and metrics, DELETE deletes the files.

A server of its own (real model, real Redis), with its disk tier in a
temporary directory, so the files a session leaves can be looked for.
"""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.live_server import ThreadServer, wait_until
from cache.forget import owner_digest
from cache.hashing import ROOT_HASH, BlockHasher
from chatsvc.config import Settings
from chatsvc.engine.kv_disk.fileformat import parse_name
from tests.api.conftest import ACME_KEY, ADMIN_KEY, BLOCK_SIZE, TEST_LIMITS, engine_config
from tests.http_helpers import client, new_session, say, unique
from tests.redis_server import unique_prefix

pytestmark = pytest.mark.slow
# Long enough that a system prompt fills a few blocks.
SYSTEM = "You are a careful travel assistant. Answer in one short sentence. " * 3


@pytest.fixture(scope="module")
def server(redis_server, tmp_path_factory):
    kv_dir = tmp_path_factory.mktemp("kv")
    settings = Settings(
        redis_url=redis_server.url,
        key_prefix=unique_prefix("kvdisk"),
        admin_key=ADMIN_KEY,
        api_keys=(("acme", ACME_KEY),),
        limits=TEST_LIMITS,
        engine=dataclasses.replace(engine_config(), kv_disk_dir=str(kv_dir)),
    )
    from chatsvc.api.app import create_app

    with ThreadServer(create_app(settings)) as live:
        live.kv_dir = kv_dir
        yield live


@pytest.fixture
def acme(server):
    with client(server.url, ACME_KEY, 300) as http:
        yield http


@pytest.fixture
def admin(server):
    with client(server.url, ADMIN_KEY, 300) as http:
        yield http


def settled(admin) -> dict:
    """The disk tier's stats once every queued write has landed (a readiness wait)."""
    holder = {}

    def idle() -> bool:
        holder["disk"] = admin.get("/admin/cache").json()["engine"]["disk"]
        return holder["disk"]["queued_jobs"] == 0 and holder["disk"]["writing"] == 0

    wait_until(idle, 120, "the disk tier's writes")
    return holder["disk"]


def files_of(server, owner: bytes) -> dict[bytes, object]:
    tag = f"-{owner.hex()}-"
    return {parse_name(p.name).hash: p for p in server.kv_dir.rglob("*.kv") if tag in p.name}


def acme_tenant(server):
    return server.call(server.services.store.tenants.by_name("acme"))


def tenant_salt(server) -> bytes:
    return acme_tenant(server).cache_salt


def chain(tokens: list[int], salt: bytes) -> list[bytes]:
    from cache import Namespace

    namespace = Namespace(tenant_salt=salt)
    hasher, parent, out = BlockHasher(BLOCK_SIZE), ROOT_HASH, []
    for i in range(len(tokens) // BLOCK_SIZE):
        block = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        parent = hasher.hash_block(parent, block, namespace.key(i, BLOCK_SIZE))
        out.append(parent)
    return out


def stored_tokens(server, session_id: str) -> list[int]:
    store = server.services.store
    tenant = acme_tenant(server)
    return list(server.call(store.sessions.get(tenant.id, session_id)).token_ids)


def samples(text: str) -> dict:
    """Samples by (name, labels), without the ``replica`` label every sample carries."""
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_usage_admin_and_metrics_show_each_tier(acme, admin):
    before = samples(admin.get("/metrics").text)
    session = new_session(acme, system_prompt=unique(SYSTEM))
    first = say(acme, session["id"], unique("Lisbon?"))
    second = say(acme, session["id"], unique("Porto?"))
    for turn in (first, second):
        usage = turn["usage"]
        assert set(usage["cached_tokens_by_tier"]) == {"device", "host", "disk"}
        assert sum(usage["cached_tokens_by_tier"].values()) == usage["cached_tokens"]
    assert second["usage"]["cached_tokens_by_tier"]["device"] > 0
    disk = settled(admin)
    assert disk["stored_blocks"] > 0 and 0 < disk["used_bytes"] <= disk["budget_bytes"]
    reasons = {"corrupt", "foreign", "budget", "queue_full", "write_error"}
    assert set(disk["dropped_blocks"]) == reasons
    engine = admin.get("/admin/cache").json()["engine"]
    assert set(engine["hit_tokens_by_tier"]) == {"device", "host", "disk"}
    after = samples(admin.get("/metrics").text)

    def delta(name, labels=()):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    hits = "chatsvc_prefix_cache_hits_tokens_total"
    cached = first["usage"]["cached_tokens"] + second["usage"]["cached_tokens"]
    by_tier = {t: delta(hits, (("tier", t),)) for t in ("device", "host", "disk")}
    assert sum(by_tier.values()) == cached and by_tier["device"] > 0
    disk_label = (("tier", "disk"),)
    assert after[("chatsvc_kv_stores_blocks_total", disk_label)] == disk["stored_blocks"]
    assert after[("chatsvc_kv_stores_bytes_total", disk_label)] == disk["stored_bytes"]
    assert after[("chatsvc_kv_disk_budget_bytes", ())] == disk["budget_bytes"]
    assert ("chatsvc_kv_load_latency_seconds_count", disk_label) in after
    assert ("chatsvc_kv_dropped_blocks_total", (("reason", "corrupt"), ("tier", "disk"))) in after
    assert after[("chatsvc_kv_cache_blocks_total", disk_label)] > 0


def test_delete_removes_the_sessions_files_but_not_what_another_session_uses(server, acme, admin):
    salt = tenant_salt(server)
    system = unique(SYSTEM)
    a = new_session(acme, system_prompt=system)["id"]
    b = new_session(acme, system_prompt=system)["id"]
    say(acme, a, unique("Tell me about Kyoto."), max_tokens=16)
    say(acme, a, unique("And Osaka?"), max_tokens=16)
    say(acme, b, unique("Tell me about Oslo."), max_tokens=16)
    settled(admin)
    a_owner, b_owner = owner_digest(salt, a), owner_digest(salt, b)
    a_files = files_of(server, a_owner)
    b_chain = chain(stored_tokens(server, b), salt)
    # A computed the system prompt's blocks first; B uses them.
    shared = [h for h in a_files if h in b_chain]
    assert shared and len(a_files) > len(shared)
    b_before = say(acme, b, unique("And Bergen?"))["usage"]["cached_tokens"]
    settled(admin)

    assert acme.delete(f"/sessions/{a}").status_code == 204
    left = files_of(server, a_owner)
    assert set(left) == set(shared)  # every other file of A is gone
    assert all(not p.exists() for h, p in a_files.items() if h not in shared)
    assert files_of(server, b_owner)  # B's own blocks are untouched
    # B's next turn still reuses its whole history.
    b_tokens = stored_tokens(server, b)
    b_next = say(acme, b, unique("And Tromso?"))["usage"]
    assert b_next["cached_tokens"] >= b_before and b_next["cached_tokens"] == (
        (len(b_tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE
    )
    assert admin.get("/admin/cache").json()["integrity"] == "ok"


def test_delete_of_a_session_that_shares_nothing_leaves_no_file_of_it(server, acme, admin):
    salt = tenant_salt(server)
    session = new_session(acme, system_prompt=unique(SYSTEM))["id"]
    say(acme, session, unique("Tell me about Lima."), max_tokens=16)
    settled(admin)
    owner = owner_digest(salt, session)
    assert files_of(server, owner)
    deleted_before = admin.get("/admin/cache").json()["engine"]["disk"]["deleted_blocks"]
    assert acme.delete(f"/sessions/{session}").status_code == 204
    assert files_of(server, owner) == {}
    disk = admin.get("/admin/cache").json()["engine"]["disk"]
    assert disk["deleted_blocks"] > deleted_before
    assert acme.delete(f"/sessions/{session}").status_code == 404


def test_delete_removes_the_files_of_every_branch_not_only_the_active_one(server, acme, admin):
    salt = tenant_salt(server)
    session = new_session(acme, system_prompt=unique(SYSTEM))["id"]
    say(acme, session, unique("Tell me about Quito."), max_tokens=16)
    say(acme, session, unique("What should I pack for it?"), max_tokens=24)
    old_tokens = stored_tokens(server, session)
    messages = acme.get(f"/sessions/{session}/messages").json()["messages"]
    # An edit of the second question branches from the first answer; the edit then
    # has its answer regenerated: three branches, the last one active.
    turns = f"/sessions/{session}/messages"
    body = {"max_tokens": 24, "temperature": 0}
    edit = {"content": unique("And what to eat there?"), "parent_message_id": messages[2]["id"]}
    assert acme.post(turns, json={**body, **edit}).status_code == 200
    again = {"regenerate": True, "temperature": 1.0, "seed": 3}
    assert acme.post(turns, json={**body, **again}).status_code == 200
    settled(admin)
    owner = owner_digest(salt, session)
    files = files_of(server, owner)
    active = set(chain(stored_tokens(server, session), salt))
    others = set(chain(old_tokens, salt)) - active
    # The branch the edit left holds blocks of its own, on disk under the session's tag.
    assert others & set(files)

    assert acme.delete(f"/sessions/{session}").status_code == 204
    assert files_of(server, owner) == {}
    assert all(not path.exists() for path in files.values())
    assert admin.get("/admin/cache").json()["integrity"] == "ok"


EDIT = "What is the weather like in every season, and what should I wear in each?"


def _branched(server, acme, admin):
    """A session of two turns whose second question was then edited: two branches,
    the edit active. Returns (session, the edit's body, the first branch's tokens,
    the edit's tokens)."""
    session = new_session(acme, system_prompt=unique(SYSTEM))["id"]
    say(acme, session, unique("Tell me about Bogota."), max_tokens=16)
    say(acme, session, unique("Where should I stay?"), max_tokens=24)
    first = stored_tokens(server, session)
    answer = acme.get(f"/sessions/{session}/messages").json()["messages"][2]
    edit = {"content": unique(EDIT), "parent_message_id": answer["id"], "temperature": 0}
    turn = acme.post(f"/sessions/{session}/messages", json={"max_tokens": 24, **edit})
    assert turn.status_code == 200, turn.text
    settled(admin)
    return session, edit, first, stored_tokens(server, session)


def test_deleting_a_branch_removes_its_kv_and_keeps_the_branch_left(server, acme, admin):
    salt = tenant_salt(server)
    session, edit, kept, edited = _branched(server, acme, admin)
    owner = owner_digest(salt, session)
    kept_blocks = set(chain(kept, salt))
    shared = [h for h in chain(edited, salt) if h in kept_blocks]
    edit_only = set(chain(edited, salt)) - kept_blocks
    files = files_of(server, owner)
    assert shared and edit_only & set(files)
    kept_files = kept_blocks & set(files)

    edited_question = acme.get(f"/sessions/{session}/messages").json()["messages"][3]
    assert edited_question["content"] == edit["content"]
    path = f"/sessions/{session}/messages/{edited_question['id']}"
    assert acme.delete(path).status_code == 204
    left = set(files_of(server, owner))
    assert not edit_only & left  # the deleted question's KV is gone from disk
    assert kept_files <= left
    assert stored_tokens(server, session) == kept
    # The branch left still reuses its whole history.
    usage = say(acme, session, unique("And the food?"))["usage"]
    assert usage["cached_tokens"] == (len(kept) - 1) // BLOCK_SIZE * BLOCK_SIZE
    # The deleted question asked again finds only the head both branches shared: its
    # own blocks are gone from memory too.
    again = acme.post(f"/sessions/{session}/messages", json={"max_tokens": 4, **edit})
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["cached_tokens"] == len(shared) * BLOCK_SIZE
    assert admin.get("/admin/cache").json()["integrity"] == "ok"


def test_deleting_a_conversation_item_removes_the_kv_rendered_with_it(server, acme, admin):
    salt = tenant_salt(server)
    session = new_session(acme, system_prompt=unique(SYSTEM))["id"]
    say(acme, session, unique("My passport number is X1234567. Where can I fly?"))
    say(acme, session, unique("And by train?"), max_tokens=16)
    settled(admin)
    before = stored_tokens(server, session)
    owner = owner_digest(salt, session)
    files = set(files_of(server, owner))
    question = acme.get(f"/sessions/{session}/messages").json()["messages"][1]
    assert "passport" in question["content"]

    item = f"/v1/conversations/{session}/items/{question['id']}"
    assert acme.delete(item).status_code == 200
    # What follows the item stays (to be rendered again); the history now ends before it.
    head = stored_tokens(server, session)
    assert before[: len(head)] == head and len(head) < len(before)
    head_blocks = set(chain(head, salt))
    assert files - head_blocks  # the item's text and what followed it were on disk ...
    assert set(files_of(server, owner)) <= head_blocks  # ... and every such file is gone
    assert admin.get("/admin/cache").json()["integrity"] == "ok"
