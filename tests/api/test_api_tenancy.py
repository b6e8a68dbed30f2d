"""KV sharing across tenants: only blocks wholly inside a shared system prompt that the
operator published and the request names; private prompts, their delete, and sessions
that outlive the prompt they started on."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.api.conftest import ACME_KEY, BLOCK_SIZE, keyspace, new_session, say, unique

# Long enough to fill several blocks, so the shared part is measurable.
POLICY = (
    "You are the support assistant of a hardware store. Answer briefly and politely, "
    "recommend only products the store sells, and never invent prices or stock levels. "
    "If a question is about safety, tell the customer to read the product manual first."
)


def publish(admin, text: str) -> dict:
    response = admin.post("/admin/system-prompts", json={"name": "policy", "text": text})
    assert response.status_code == 201, response.text
    return response.json()


def complete(http, system_text: str | None, question: str, **extension) -> dict:
    """One greedy /v1/chat/completions call that must succeed; returns its usage."""
    messages = [{"role": "user", "content": question}]
    if system_text is not None:
        messages.insert(0, {"role": "system", "content": system_text})
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
        **extension,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def prompt_ids(http) -> list[str]:
    return [p["id"] for p in http.get("/system-prompts").json()["system_prompts"]]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_shared_prompt_blocks_hit_for_a_second_tenant(admin, acme, globex):
    prompt = publish(admin, unique(POLICY))
    assert prompt["shared"] is True
    shared_blocks = prompt["num_tokens"] // BLOCK_SIZE
    assert shared_blocks >= 2
    # Every tenant sees the operator's shared prompt and may start sessions on it.
    for http in (acme, globex):
        assert prompt["id"] in prompt_ids(http)

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


def test_a_guess_registered_as_shared_never_confirms_another_tenants_system_text(
    admin, acme, globex
):
    """globex (the attacker) guesses acme's private system text and gets it shared, by
    trying itself and through the operator; acme then sends that text as an ordinary
    system message. globex's own next request with the text must hit none of acme's
    blocks. (Before, any shared prompt of equal text made acme's request public, and
    globex's next request reported cached_tokens > 0.)"""
    guess = unique(POLICY)
    attempts = [
        globex.post("/system-prompts", json={"name": "guess", "text": guess, "shared": True}),
        admin.post("/admin/system-prompts", json={"name": "guess", "text": guess}),
    ]
    published = [a.json() for a in attempts if a.status_code == 201]
    assert published and all(p["shared"] for p in published)
    shared_id, num_tokens = published[-1]["id"], published[-1]["num_tokens"]
    assert num_tokens // BLOCK_SIZE >= 2

    victim = complete(acme, guess, unique("Where are the hammers?"))
    assert cached(victim) == 0
    assert cached(complete(acme, guess, unique("And nails?"))) >= 2 * BLOCK_SIZE  # warm for acme

    question = unique("Is it in stock?")
    assert cached(complete(globex, guess, question)) == 0
    # Named by id, the text is public, but acme's request did not compute it there.
    assert cached(complete(globex, None, question, system_prompt_id=shared_id)) == 0
    # Control: the public path works, for globex's own earlier computation. At least
    # the prompt's full blocks hit; the block the prompt ends in may hit too when its
    # remainder is the turn's fixed opening tokens, computed by globex's last request.
    again = complete(globex, None, unique("Shipping?"), system_prompt_id=shared_id)
    assert cached(again) >= num_tokens // BLOCK_SIZE * BLOCK_SIZE


def test_tenants_cannot_share_and_a_refusal_writes_nothing(api, raw_redis, acme, globex):
    before = keyspace(raw_redis, api.services.settings.key_prefix)
    body = {"name": "mine", "text": unique(POLICY), "shared": True}
    refused = acme.post("/system-prompts", json=body)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["type"] == "permission_error"
    assert "/admin/system-prompts" in refused.json()["error"]["message"]
    # Tenant keys do not open the operator's routes either.
    for http in (acme, globex):
        answer = http.post("/admin/system-prompts", json={"name": "x", "text": unique(POLICY)})
        assert answer.status_code == 403, answer.text
    assert keyspace(raw_redis, api.services.settings.key_prefix) == before


def test_system_prompt_id_on_the_openai_path(api, admin, acme, globex):
    shared = publish(admin, unique(POLICY))
    own = acme.post("/system-prompts", json={"name": "own", "text": unique(POLICY)}).json()
    foreign = globex.post("/system-prompts", json={"name": "g", "text": unique(POLICY)}).json()

    # The openai SDK sends the extension with extra_body.
    with openai.OpenAI(base_url=f"{api.url}/v1", api_key=ACME_KEY, max_retries=0) as sdk:
        reply = sdk.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": unique("Hi")}],
            max_tokens=1,
            extra_body={"system_prompt_id": shared["id"]},
        )
        # The prompt's text is the system message: the prompt counts its tokens.
        assert reply.usage.prompt_tokens > shared["num_tokens"]
        with pytest.raises(openai.NotFoundError):
            sdk.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=1,
                extra_body={"system_prompt_id": foreign["id"]},
            )

    # Sent along with the id, the same text is accepted; other text is a 400.
    # (Its first token differs from the SDK call's "[", which may share the last
    # block of the prompt's head; that block is acme's own, hashed privately.)
    question = f"Hello {uuid.uuid4().hex}"
    same = complete(acme, shared["text"], question, system_prompt_id=shared["id"])
    assert cached(same) == shared["num_tokens"] // BLOCK_SIZE * BLOCK_SIZE
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "system", "content": "Other."}, {"role": "user", "content": "Hi"}],
        "system_prompt_id": shared["id"],
    }
    mismatch = acme.post("/v1/chat/completions", json=body)
    assert mismatch.status_code == 400, mismatch.text
    assert "system_prompt_id" in mismatch.json()["error"]["message"]

    # Another tenant's id answers exactly like an unknown or a malformed one.
    answers = []
    for prompt_id in (foreign["id"], uuid.uuid4().hex, "../x"):
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "Hi"}],
            "system_prompt_id": prompt_id,
        }
        answers.append(acme.post("/v1/chat/completions", json=body))
    assert {a.status_code for a in answers} == {404}
    assert len({a.content for a in answers}) == 1

    # An own private prompt by id is used, and stays private to acme.
    private = complete(acme, None, unique("Hey"), system_prompt_id=own["id"])
    assert private["prompt_tokens"] > own["num_tokens"]
    assert cached(complete(globex, own["text"], unique("Hey"))) == 0


def test_cache_stats_are_kept_per_tenant_and_per_prompt(admin, acme, globex):
    prompt = publish(admin, unique(POLICY))
    for http in (acme, globex):
        say(http, new_session(http, system_prompt_id=prompt["id"])["id"], unique("Hello"))
    complete(acme, None, unique("Hello"), system_prompt_id=prompt["id"])
    # The same text sent as plain text names no prompt, so it is not counted under one.
    complete(globex, prompt["text"], unique("Hello"))
    stats = admin.get("/admin/cache").json()
    per_prompt = stats["requests"]["per_system_prompt"][prompt["id"]]
    assert per_prompt["requests"] == 3
    assert 0 < per_prompt["cached_tokens"] < per_prompt["prompt_tokens"]
    assert len(stats["requests"]["per_tenant"]) >= 2


def test_a_tenant_deletes_its_own_prompts_only(api, raw_redis, admin, acme, globex):
    mine = acme.post("/system-prompts", json={"name": "m", "text": unique(POLICY)}).json()
    shared = publish(admin, unique(POLICY))
    before = keyspace(raw_redis, api.services.settings.key_prefix)

    # Another tenant's prompt answers exactly like an unknown one, and stays.
    foreign = globex.delete(f"/system-prompts/{mine['id']}")
    unknown = globex.delete(f"/system-prompts/{uuid.uuid4().hex}")
    assert foreign.status_code == unknown.status_code == 404
    assert foreign.content == unknown.content
    # A shared prompt is the operator's to withdraw.
    refused = acme.delete(f"/system-prompts/{shared['id']}")
    assert refused.status_code == 403, refused.text
    # The operator's route withdraws shared prompts only.
    assert admin.delete(f"/admin/system-prompts/{mine['id']}").status_code == 404
    assert keyspace(raw_redis, api.services.settings.key_prefix) == before

    assert acme.delete(f"/system-prompts/{mine['id']}").status_code == 204
    assert acme.get(f"/system-prompts/{mine['id']}").status_code == 404
    assert acme.delete(f"/system-prompts/{mine['id']}").status_code == 404
    listed = admin.get("/admin/system-prompts").json()["system_prompts"]
    assert shared["id"] in [p["id"] for p in listed] and all(p["shared"] for p in listed)
    assert admin.delete(f"/admin/system-prompts/{shared['id']}").status_code == 204
    assert shared["id"] not in prompt_ids(acme)


def test_sessions_outlive_the_prompts_they_started_on(admin, acme, globex):
    own = acme.post("/system-prompts", json={"name": "o", "text": unique(POLICY)}).json()
    shared = publish(admin, unique(POLICY))
    sessions = [
        (acme, new_session(acme, system_prompt_id=own["id"])["id"], own),
        (globex, new_session(globex, system_prompt_id=shared["id"])["id"], shared),
    ]
    for http, sid, _ in sessions:
        say(http, sid, unique("First question."))

    assert acme.delete(f"/system-prompts/{own['id']}").status_code == 204
    assert admin.delete(f"/admin/system-prompts/{shared['id']}").status_code == 204

    for http, sid, prompt in sessions:
        history = http.get(f"/sessions/{sid}/messages").json()["messages"]
        assert (history[0]["role"], history[0]["content"]) == ("system", prompt["text"])
        turn = say(http, sid, unique("Second question."))
        assert turn["prefix_reused"] is True  # the stored tokens still lead the prompt
        after = http.get(f"/sessions/{sid}/messages").json()["messages"]
        assert [m["role"] for m in after] == ["system"] + ["user", "assistant"] * 2
        if not prompt["shared"]:
            # Still hashed as before: the session's own first turn is reused. (A
            # withdrawn shared prompt's blocks are public ones; its sessions now
            # hash privately and recompute their head once.)
            assert turn["usage"]["cached_tokens"] > 0
    # A new session on a deleted prompt is refused like one on an unknown prompt.
    assert acme.post("/sessions", json={"system_prompt_id": own["id"]}).status_code == 404
