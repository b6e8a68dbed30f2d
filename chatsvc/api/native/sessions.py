"""Sessions: create, list, read, delete, and the history of one."""

from __future__ import annotations

from litestar import Controller, delete, get, post
from litestar.params import FromPath, JSONBody, Parameter

from chatsvc.api.native.schemas import CreateSession, SessionList, SessionView
from chatsvc.api.shared.deps import ServicesDep, TenantDep
from chatsvc.api.shared.errors import (
    InvalidRequestError,
    NotFoundError,
    documented_errors,
)
from chatsvc.api.shared.rendering import check_text, system_prefix_tokens
from chatsvc.api.shared.session_kv import delete_session_and_kv
from chatsvc.api.shared.store_access import UNKNOWN_SESSION, get_session, visible_prompt
from chatsvc.store import InvalidInputError
from chatsvc.store.records import SessionRecord, SessionSummary

# A listing page's body stays under this many bytes (unless one session's
# metadata alone is larger: a page always holds at least one session). A
# summary's metadata is bounded (64 entries of up to 4 KB), so a full page of
# 500 would otherwise reach ~130 MB.
LIST_PAGE_MAX_BYTES = 1 << 20
# Room for the page's envelope: the list brackets, separators and the cursor.
_ENVELOPE_BYTES = 1024


def session_view(session: SessionRecord | SessionSummary) -> SessionView:
    if isinstance(session, SessionRecord):
        session = session.summary()
    return SessionView(
        id=session.id,
        system_prompt_id=session.system_prompt_id,
        metadata=session.metadata,
        num_messages=session.num_messages,
        num_tokens=session.num_tokens,
        created_at=session.created_at,
        updated_at=session.updated_at,
    )


class SessionController(Controller):
    path = "/sessions"
    tags = ["sessions"]

    @post(
        "/",
        summary="Create a session",
        status_code=201,
        responses=documented_errors(400, 401, 404, 413, 429, 503),
    )
    async def create_session(
        self, data: JSONBody[CreateSession], services: ServicesDep, tenant: TenantDep
    ) -> SessionView:
        """Start a conversation on a stored system prompt, inline text, or the model's default."""
        store = services.store
        if data.system_prompt_id is not None and data.system_prompt is not None:
            raise InvalidRequestError("give system_prompt_id or system_prompt, not both")
        text, token_ids = None, []
        if data.system_prompt_id is not None:
            prompt = await visible_prompt(services, tenant, data.system_prompt_id)
            text, token_ids = prompt.text, list(prompt.token_ids)
        elif data.system_prompt is not None:
            text = check_text(data.system_prompt, services, "system prompt")
            token_ids = await system_prefix_tokens(services, text)
        try:
            session = await store.sessions.create(
                tenant.id,
                data.system_prompt_id,
                text,
                token_ids,
                data.metadata,
                max_sessions=services.settings.limits.max_sessions_per_tenant,
            )
        except InvalidInputError as exc:
            raise InvalidRequestError(str(exc)) from None
        return session_view(session)

    @get(
        "/",
        summary="List the tenant's sessions, most recently used first",
        responses=documented_errors(400, 401, 503),
    )
    async def list_sessions(
        self,
        services: ServicesDep,
        tenant: TenantDep,
        limit: int = Parameter(default=50, ge=1, le=500),
        cursor: str | None = Parameter(default=None, max_length=200),
    ) -> SessionList:
        """One page of session summaries (no history), up to ``limit`` and about 1 MB;
        pass ``next_cursor`` back as ``cursor`` for the next."""
        try:
            sessions, next_cursor = await services.store.sessions.list_page(
                tenant.id,
                limit=limit,
                cursor=cursor,
                max_bytes=LIST_PAGE_MAX_BYTES - _ENVELOPE_BYTES,
            )
        except InvalidInputError as exc:
            raise InvalidRequestError(f"bad cursor: {exc}") from None
        return SessionList(
            sessions=[session_view(s) for s in sessions],
            next_cursor=None if next_cursor is None else str(next_cursor),
        )

    @get(
        "/{session_id:str}",
        summary="Read a session",
        responses=documented_errors(400, 401, 404, 503),
    )
    async def read_session(
        self, session_id: FromPath[str], services: ServicesDep, tenant: TenantDep
    ) -> SessionView:
        session = await get_session(services, tenant, session_id)
        if session is None:
            raise NotFoundError(UNKNOWN_SESSION)
        return session_view(session)

    @delete(
        "/{session_id:str}",
        summary="Delete a session and every key it has",
        status_code=204,
        responses=documented_errors(400, 401, 404, 503),
    )
    async def delete_session(
        self, session_id: FromPath[str], services: ServicesDep, tenant: TenantDep
    ) -> None:
        """Delete the session's keys, then its KV blocks in every tier (files included)."""
        if not await delete_session_and_kv(services, tenant, session_id):
            raise NotFoundError(UNKNOWN_SESSION)
