"""OpenAI's Conversations API: a conversation *is* a session.

The conversation id is the session id, so a conversation is visible (and
usable) through /sessions as well, under the same tenant isolation (another
tenant's id answers 404 like an unknown one), TTL, limits, one-turn-at-a-time
rule and crash safety. Its items are the messages of the session's active
branch; ``POST /v1/responses`` with ``conversation`` adds a turn to it.

Items added here are stored without running the model: they hold no token
ids, and the next response renders them (tree.py). Writes take the session's
turn lock, so they never interleave with a running turn (409).
"""

from __future__ import annotations

from litestar import Controller, delete, get, post
from litestar.params import FromPath, JSONBody, Parameter

from chatsvc.api.openai.response_schemas import (
    AddItems,
    ConversationDeleted,
    ConversationObject,
    CreateConversation,
    InputMessage,
    Item,
    ItemList,
    UpdateConversation,
)
from chatsvc.api.openai.response_views import DEFAULT_PAGE, MAX_PAGE, item_view, page_of
from chatsvc.api.shared.deps import ServicesDep, TenantDep
from chatsvc.api.shared.errors import (
    InvalidRequestError,
    NotFoundError,
    documented_errors,
)
from chatsvc.api.shared.rendering import check_text
from chatsvc.api.shared.session_kv import delete_session_and_kv, delete_with_kv
from chatsvc.api.shared.store_access import get_session, locked_write, read_page
from chatsvc.service import Services
from chatsvc.store import InvalidInputError
from chatsvc.store.errors import MalformedIdError
from chatsvc.store.records import MessageRecord, SessionRecord, SessionSummary, TenantRecord
from chatsvc.store.tree import new_message_id

UNKNOWN_CONVERSATION = "no such conversation"
UNKNOWN_ITEM = "no such item in this conversation"
# OpenAI's own bound on the items of one create or add call.
MAX_ITEMS_PER_CALL = 20


def conversation_view(session: SessionRecord | SessionSummary) -> ConversationObject:
    return ConversationObject(
        id=session.id, created_at=int(session.created_at), metadata=session.metadata
    )


class ConversationController(Controller):
    path = "/v1/conversations"
    tags = ["openai"]

    @post(
        "/",
        summary="Create a conversation (a session), optionally with items",
        status_code=200,
        responses=documented_errors(400, 401, 413, 429, 503),
    )
    async def create_conversation(
        self, data: JSONBody[CreateConversation], services: ServicesDep, tenant: TenantDep
    ) -> ConversationObject:
        records = _records(services, data.items or [])
        try:
            session = await services.store.sessions.create(
                tenant.id,
                None,
                None,
                None,
                data.metadata,
                messages=records,
                kind="conversation",
                max_sessions=services.settings.limits.max_sessions_per_tenant,
            )
        except InvalidInputError as exc:
            raise InvalidRequestError(str(exc)) from None
        return conversation_view(session)

    @get(
        "/{conversation_id:str}",
        summary="Read a conversation",
        responses=documented_errors(400, 401, 404, 503),
    )
    async def read_conversation(
        self, conversation_id: FromPath[str], services: ServicesDep, tenant: TenantDep
    ) -> ConversationObject:
        return conversation_view(await _session(services, tenant, conversation_id))

    @post(
        "/{conversation_id:str}",
        summary="Replace a conversation's metadata",
        status_code=200,
        responses=documented_errors(400, 401, 404, 409, 413, 503),
    )
    async def update_conversation(
        self,
        conversation_id: FromPath[str],
        data: JSONBody[UpdateConversation],
        services: ServicesDep,
        tenant: TenantDep,
    ) -> ConversationObject:
        async def write(lock, write_id):
            return await services.store.branches.update_metadata(
                tenant.id, conversation_id, data.metadata, lock=lock, write_id=write_id
            )

        try:
            await locked_write(services, tenant, conversation_id, write)
        except TypeError as exc:
            raise InvalidRequestError(str(exc)) from None
        return conversation_view(await _session(services, tenant, conversation_id))

    @delete(
        "/{conversation_id:str}",
        summary="Delete a conversation (its session, every message and response)",
        status_code=200,
        responses=documented_errors(400, 401, 404, 503),
    )
    async def delete_conversation(
        self, conversation_id: FromPath[str], services: ServicesDep, tenant: TenantDep
    ) -> ConversationDeleted:
        # With its KV in every tier, as DELETE /sessions/{id} does: it is that session.
        deleted = await delete_session_and_kv(services, tenant, conversation_id)
        if not deleted:
            raise NotFoundError(UNKNOWN_CONVERSATION)
        return ConversationDeleted(id=conversation_id)

    @get(
        "/{conversation_id:str}/items",
        summary="The conversation's items (its active branch)",
        responses=documented_errors(400, 401, 404, 503),
    )
    async def list_items(
        self,
        conversation_id: FromPath[str],
        services: ServicesDep,
        tenant: TenantDep,
        after: str | None = Parameter(default=None, max_length=64),
        limit: int = Parameter(default=DEFAULT_PAGE, ge=1, le=MAX_PAGE),
        order: str = Parameter(default="desc", pattern="^(asc|desc)$"),
    ) -> ItemList:
        """``order`` desc (the default): newest first; pass ``last_id`` as ``after``.
        The store reads only the page."""
        page = await read_page(
            services, tenant, conversation_id, limit=limit, after=after, order=order
        )
        items = [item_view(m) for m in page.messages]
        return ItemList(
            data=items,
            first_id=items[0].id if items else None,
            last_id=items[-1].id if items else None,
            has_more=page.has_more,
        )

    @post(
        "/{conversation_id:str}/items",
        summary="Add items to a conversation (no response is generated)",
        status_code=200,
        responses=documented_errors(400, 401, 404, 409, 413, 429, 503),
    )
    async def add_items(
        self,
        conversation_id: FromPath[str],
        data: JSONBody[AddItems],
        services: ServicesDep,
        tenant: TenantDep,
    ) -> ItemList:
        records = _records(services, data.items)
        if not records:
            raise InvalidRequestError("items must hold at least one message")

        async def write(lock, write_id):
            return await services.store.branches.add_messages(
                tenant.id,
                conversation_id,
                records,
                lock=lock,
                write_id=write_id,
                max_nodes=services.settings.limits.max_messages_per_session,
            )

        await locked_write(services, tenant, conversation_id, write)
        items = [item_view(m) for m in records]
        return page_of(items, after=None, limit=len(items), order="asc")

    @get(
        "/{conversation_id:str}/items/{item_id:str}",
        summary="Read one item of a conversation",
        responses=documented_errors(400, 401, 404, 503),
    )
    async def read_item(
        self,
        conversation_id: FromPath[str],
        item_id: FromPath[str],
        services: ServicesDep,
        tenant: TenantDep,
    ) -> Item:
        try:
            found = await services.store.tree.messages_by_id(tenant.id, conversation_id, [item_id])
        except MalformedIdError:
            found = None
        if found is None:
            raise NotFoundError(UNKNOWN_CONVERSATION)
        if found[0] is None:
            raise NotFoundError(UNKNOWN_ITEM)
        return item_view(found[0])

    @delete(
        "/{conversation_id:str}/items/{item_id:str}",
        summary="Delete one item of a conversation (what follows it stays)",
        status_code=200,
        responses=documented_errors(400, 401, 404, 409, 503),
    )
    async def delete_item(
        self,
        conversation_id: FromPath[str],
        item_id: FromPath[str],
        services: ServicesDep,
        tenant: TenantDep,
    ) -> ConversationObject:
        await delete_with_kv(
            services,
            tenant,
            conversation_id,
            lambda lock, write_id: services.store.branches.delete_message(
                tenant.id, conversation_id, item_id, lock=lock, write_id=write_id
            ),
        )
        return conversation_view(await _session(services, tenant, conversation_id))


async def _session(services: Services, tenant: TenantRecord, conversation_id: str):
    session = await get_session(services, tenant, conversation_id)
    if session is None:
        raise NotFoundError(UNKNOWN_CONVERSATION)
    return session


def _records(services: Services, items: list[InputMessage]) -> list[MessageRecord]:
    """Items as messages to store; 400 for too many, empty or oversized ones."""
    if len(items) > MAX_ITEMS_PER_CALL:
        raise InvalidRequestError(f"{len(items)} items; add at most {MAX_ITEMS_PER_CALL} at a time")
    return [
        MessageRecord(
            role=item.stored_role(),
            text=check_text(item.text(), services, f"items[{i}]"),
            token_ids=[],
            id=new_message_id(),
        )
        for i, item in enumerate(items)
    ]
