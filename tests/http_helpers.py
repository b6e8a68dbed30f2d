"""Small HTTP helpers the API and reliability suites share (a live server, real Redis)."""

from __future__ import annotations

import uuid

import httpx
import redis


def client(base_url: str, key: str | None, timeout_s: float = 120) -> httpx.Client:
    """A client of the live server, with the tenant's (or admin's) key when given."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.Client(base_url=base_url, headers=headers, timeout=timeout_s)


def keyspace(raw_redis: redis.Redis, prefix: str) -> dict[bytes, bytes]:
    """Every key under ``prefix`` with its serialized value (DUMP): a full snapshot."""
    return {key: raw_redis.dump(key) for key in raw_redis.scan_iter(match=f"{prefix}:*")}


def unique(text: str) -> str:
    """``text`` tagged so that no other test (or earlier run) sent the same tokens."""
    return f"[{uuid.uuid4().hex[:8]}] {text}"


def new_session(http: httpx.Client, **body) -> dict:
    response = http.post("/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def say(http: httpx.Client, session_id: str, text: str, max_tokens: int = 8, **options) -> dict:
    """One greedy turn that must succeed; returns the JSON answer."""
    body = {"content": text, "max_tokens": max_tokens, "temperature": 0, **options}
    response = http.post(f"/sessions/{session_id}/messages", json=body)
    assert response.status_code == 200, response.text
    return response.json()
