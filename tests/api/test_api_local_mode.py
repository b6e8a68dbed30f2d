"""Local mode: no API keys, embedded Redis in the data dir, one tenant without auth."""

from __future__ import annotations

import httpx

from bench.live_server import ThreadServer
from chatsvc.api.app import create_app
from chatsvc.config import Settings
from tests.api.conftest import engine_config

# A cold first turn on a busy machine takes longer than httpx's default 5 s.
TIMEOUT_S = 300


def test_local_mode_serves_without_keys_and_keeps_its_tenant(tmp_path):
    settings = Settings(data_dir=tmp_path, engine=engine_config())
    assert not settings.auth_enabled and settings.redis_url is None

    with (
        ThreadServer(create_app(settings)) as server,
        httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http,
    ):
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
        # The default settings answer to loopback names only (DNS-rebinding guard).
        assert http.get("/sessions", headers={"Host": f"localhost:{server.port}"}).is_success
        foreign = http.get("/sessions", headers={"Host": f"rebound.example:{server.port}"})
        assert foreign.status_code == 400
    assert (tmp_path / "redis").is_dir()  # the embedded server kept its data here
    # The local tenant is found by its name; no key of it is kept anywhere.
    assert not (tmp_path / "local_tenant.key").exists()

    # Started again on the same data dir: same tenant, same history.
    with (
        ThreadServer(create_app(settings)) as server,
        httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http,
    ):
        history = http.get(f"/sessions/{session['id']}/messages")
        assert history.status_code == 200
        assert [m["role"] for m in history.json()["messages"]] == ["user", "assistant"]
