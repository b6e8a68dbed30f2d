"""Local mode: no API keys, embedded Redis in the data dir, one tenant without auth."""

from __future__ import annotations

import httpx

from chatsvc.api.app import create_app
from chatsvc.config import Settings
from tests.api.conftest import engine_config
from tests.api.live_server import ThreadServer


def test_local_mode_serves_without_keys_and_keeps_its_tenant(tmp_path):
    settings = Settings(data_dir=tmp_path, engine=engine_config())
    assert not settings.auth_enabled and settings.redis_url is None

    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url) as http:
        session = http.post("/sessions", json={}).json()
        turn = http.post(
            f"/sessions/{session['id']}/messages", json={"content": "Hi", "max_tokens": 4}
        )
        assert turn.status_code == 200
        assert http.get("/admin/cache").status_code == 200  # admin is open in local mode
        # So is publishing a shared prompt; the tenant's own route still cannot share.
        published = http.post("/admin/system-prompts", json={"name": "p", "text": "Be brief."})
        assert published.status_code == 201 and published.json()["shared"] is True
        own = http.post("/system-prompts", json={"name": "q", "text": "Hi.", "shared": True})
        assert own.status_code == 403
        assert http.get("/readyz").status_code == 200
    assert (tmp_path / "redis").is_dir()  # the embedded server kept its data here
    # The local tenant is found by its name; no key of it is kept anywhere.
    assert not (tmp_path / "local_tenant.key").exists()

    # Started again on the same data dir: same tenant, same history.
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url) as http:
        history = http.get(f"/sessions/{session['id']}/messages")
        assert history.status_code == 200
        assert [m["role"] for m in history.json()["messages"]] == ["user", "assistant"]
