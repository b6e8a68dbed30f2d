"""KV sharing across tenants: only blocks wholly inside a shared system prompt."""

from __future__ import annotations

from tests.api.conftest import BLOCK_SIZE, new_session, say, unique

# Long enough to fill several blocks, so the shared part is measurable.
POLICY = (
    "You are the support assistant of a hardware store. Answer briefly and politely, "
    "recommend only products the store sells, and never invent prices or stock levels. "
    "If a question is about safety, tell the customer to read the product manual first."
)


def test_shared_prompt_blocks_hit_for_a_second_tenant(acme, globex):
    prompt = acme.post(
        "/system-prompts", json={"name": "policy", "text": unique(POLICY), "shared": True}
    ).json()
    assert prompt["shared"] is True
    shared_blocks = prompt["num_tokens"] // BLOCK_SIZE
    assert shared_blocks >= 2
    # globex sees acme's shared prompt and may start sessions on it.
    assert prompt["id"] in [p["id"] for p in globex.get("/system-prompts").json()["system_prompts"]]

    first = say(acme, new_session(acme, system_prompt_id=prompt["id"])["id"], unique("Hi!"))
    assert first["usage"]["cached_tokens"] == 0
    second = say(globex, new_session(globex, system_prompt_id=prompt["id"])["id"], unique("Yo"))
    # Every full block of the shared prompt is reused; the block holding the
    # first private token (globex's text) is not.
    assert second["usage"]["cached_tokens"] == shared_blocks * BLOCK_SIZE


def test_private_text_never_hits_across_tenants(acme, globex):
    text = unique(POLICY)  # same private system prompt, same message, two tenants
    question = unique("Do you sell hammers?")
    a = say(acme, new_session(acme, system_prompt=text)["id"], question)
    b = say(globex, new_session(globex, system_prompt=text)["id"], question)
    assert a["usage"]["cached_tokens"] == 0
    assert b["usage"]["cached_tokens"] == 0
    # Control: the same tenant does hit on its own identical prompt.
    again = say(acme, new_session(acme, system_prompt=text)["id"], question)
    assert (
        again["usage"]["cached_tokens"]
        >= (again["usage"]["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE
    )


def test_cache_stats_are_kept_per_tenant_and_per_prompt(admin, acme, globex):
    prompt = acme.post(
        "/system-prompts", json={"name": "p", "text": unique(POLICY), "shared": True}
    ).json()
    for http in (acme, globex):
        say(http, new_session(http, system_prompt_id=prompt["id"])["id"], unique("Hello"))
    stats = admin.get("/admin/cache").json()
    per_prompt = stats["requests"]["per_system_prompt"][prompt["id"]]
    assert per_prompt["requests"] == 2
    assert 0 < per_prompt["cached_tokens"] < per_prompt["prompt_tokens"]
    assert len(stats["requests"]["per_tenant"]) >= 2
