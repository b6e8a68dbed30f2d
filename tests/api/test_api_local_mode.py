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
        assert http.get("/readyz").status_code == 200
    assert (tmp_path / "redis").is_dir()  # the embedded server kept its data here
    key_file = tmp_path / "local_tenant.key"
    assert key_file.stat().st_mode & 0o077 == 0  # the local tenant's key is private

    # Started again on the same data dir: same tenant, same history.
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url) as http:
        history = http.get(f"/sessions/{session['id']}/messages")
        assert history.status_code == 200
        assert [m["role"] for m in history.json()["messages"]] == ["user", "assistant"]
