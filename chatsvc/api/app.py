"""The Litestar application."""

from __future__ import annotations

from litestar import Litestar, get


@get("/healthz", sync_to_thread=False)
def healthz() -> dict[str, str]:
    return {"status": "ok"}


def create_app() -> Litestar:
    return Litestar(route_handlers=[healthz])
