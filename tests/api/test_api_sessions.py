"""Sessions CRUD, history, tenant isolation and authentication."""

from __future__ import annotations

from tests.api.conftest import client, new_session, say, unique


def test_create_read_list_delete(acme):
    session = new_session(acme, system_prompt=unique("You are terse."), metadata={"k": "v"})
    assert session["metadata"] == {"k": "v"}
    assert session["num_messages"] == 1  # the system message
    assert session["num_tokens"] > 0

    read = acme.get(f"/sessions/{session['id']}")
    assert read.status_code == 200
    assert read.json()["id"] == session["id"]

    listed = acme.get("/sessions", params={"limit": 500}).json()
    assert session["id"] in [s["id"] for s in listed["sessions"]]

    assert acme.delete(f"/sessions/{session['id']}").status_code == 204
    assert acme.get(f"/sessions/{session['id']}").status_code == 404
    assert acme.delete(f"/sessions/{session['id']}").status_code == 404


def test_listing_pages_with_a_cursor(acme):
    ids = {new_session(acme)["id"] for _ in range(3)}
    seen: list[str] = []
    cursor = None
    for _ in range(1000):
        params = {"limit": 2} | ({} if cursor is None else {"cursor": cursor})
        page = acme.get("/sessions", params=params).json()
        assert len(page["sessions"]) <= 2
        seen.extend(s["id"] for s in page["sessions"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert ids <= set(seen)
    assert len(seen) == len(set(seen))


def test_history_holds_both_messages_of_a_turn(acme):
    session = new_session(acme)
    result = say(acme, session["id"], unique("Say hello."))
    history = acme.get(f"/sessions/{session['id']}/messages").json()["messages"]
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert history[1]["content"] == result["message"]["content"]
    assert acme.get(f"/sessions/{session['id']}").json()["num_messages"] == 2


def test_other_tenants_session_answers_like_an_unknown_one(acme, globex):
    session = new_session(acme)
    sid = session["id"]
    unknown = "0" * 32
    for method, path, body in [
        ("GET", "/sessions/{}", None),
        ("GET", "/sessions/{}/messages", None),
        ("DELETE", "/sessions/{}", None),
        ("POST", "/sessions/{}/messages", {"content": "hi", "max_tokens": 1}),
    ]:
        theirs = globex.request(method, path.format(sid), json=body)
        missing = globex.request(method, path.format(unknown), json=body)
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json() == missing.json()
        assert theirs.json()["error"]["type"] == "not_found_error"
    assert sid not in [s["id"] for s in globex.get("/sessions").json()["sessions"]]
    assert acme.get(f"/sessions/{sid}").status_code == 200  # untouched by globex


def test_requests_without_a_valid_key_get_401(api):
    for key in (None, "not-a-real-key-000"):
        with client(api, key) as anonymous:
            for method, path in [
                ("GET", "/sessions"),
                ("POST", "/sessions"),
                ("GET", "/v1/models"),
            ]:
                response = anonymous.request(method, path, json={} if method == "POST" else None)
                assert response.status_code == 401
                assert response.json()["error"]["type"] == "authentication_error"


def test_system_prompt_by_id(acme, globex):
    prompt = acme.post(
        "/system-prompts", json={"name": "terse", "text": unique("Answer in one word.")}
    )
    assert prompt.status_code == 201
    prompt = prompt.json()
    assert prompt["num_tokens"] > 0 and prompt["shared"] is False
    session = new_session(acme, system_prompt_id=prompt["id"])
    assert session["system_prompt_id"] == prompt["id"]
    assert prompt["id"] in [p["id"] for p in acme.get("/system-prompts").json()["system_prompts"]]
    # A private prompt is invisible to other tenants, even by id.
    assert globex.get(f"/system-prompts/{prompt['id']}").status_code == 404
    assert globex.post("/sessions", json={"system_prompt_id": prompt["id"]}).status_code == 404
