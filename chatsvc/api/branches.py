"""A session's branches in the native API: switch the active one, delete one.

A session's messages form a tree (chatsvc/store/tree.py): regenerating an
answer or editing a message adds a sibling, and the new branch becomes the
active one. ``GET /sessions/{id}/messages`` shows a branch with each message's
siblings; the routes here move the active branch and remove branches. Both
take the session's turn lock, so they never run beside a turn (409).
"""

from __future__ import annotations

import secrets

from litestar import Controller, delete, put
from litestar.params import FromPath, JSONBody

from chatsvc.api.deps import ServicesDep, TenantDep
from chatsvc.api.errors import NotFoundError, documented_errors
from chatsvc.api.schemas import MessageList, MessageView, SwitchBranch
from chatsvc.api.session_kv import forget_removed_kv
from chatsvc.api.turn_prompt import UNKNOWN_MESSAGE, UNKNOWN_SESSION
from chatsvc.service import Services
from chatsvc.store import InvalidInputError
from chatsvc.store.branch_read import Branch
from chatsvc.store.records import MessageRecord, TenantRecord


def message_view(message: MessageRecord, siblings: list[str] | None = None) -> MessageView:
    return MessageView(
        id=message.id,
        role=message.role,
        content=message.text,
        created_at=message.created_at,
        parent_id=message.parent_id,
        sibling_ids=list(siblings or [message.id]),
    )


def branch_view(session_id: str, branch: Branch) -> MessageList:
    pairs = zip(branch.messages, branch.siblings, strict=True)
    return MessageList(
        session_id=session_id,
        messages=[message_view(message, siblings) for message, siblings in pairs],
        continuations=branch.continuations,
    )


async def read_branch(
    services: Services, tenant: TenantRecord, session_id: str, leaf_id: str | None = None
) -> Branch:
    """The branch ending at ``leaf_id`` (None: the active one); 404 when the session or
    the message is unknown (or another tenant's: the same answer)."""
    try:
        branch = await services.store.get_branch(tenant.id, session_id, leaf_id)
    except InvalidInputError:  # a malformed id names nothing
        branch = None
    if branch is None:
        raise NotFoundError(UNKNOWN_SESSION if leaf_id is None else UNKNOWN_MESSAGE)
    return branch


async def locked_write(services: Services, tenant: TenantRecord, session_id: str, write):
    """Run ``write(lock, write_id)`` under the session's turn lock: 404 for an unknown
    session or message, 409 while a turn runs. The write id is fresh per request; a
    resend of the same script after a lost reply carries it and is applied once."""
    store = services.store
    try:
        async with store.turn_lock(tenant.id, session_id) as lock:
            return await write(lock, secrets.token_hex(16))
    except InvalidInputError:  # a malformed session or message id names nothing
        raise NotFoundError(UNKNOWN_SESSION) from None


async def delete_with_kv(services: Services, tenant: TenantRecord, session_id: str, delete):
    """``locked_write`` of ``delete(lock, write_id)``, a write that removes messages;
    then the KV of the branch histories it removed goes too (session_kv.py)."""
    store = services.store

    async def write(lock, write_id):
        before = await store.branch_histories(tenant.id, session_id)
        await delete(lock, write_id)
        return before, await store.branch_histories(tenant.id, session_id)

    before, after = await locked_write(services, tenant, session_id, write)
    session = await store.peek_session(tenant.id, session_id)
    if session is not None:
        await forget_removed_kv(services, tenant, session, before, after)


class BranchController(Controller):
    path = "/sessions/{session_id:str}"
    tags = ["sessions"]

    @put(
        "/branch",
        summary="Make the branch through a message the active one",
        status_code=200,
        responses=documented_errors(400, 401, 404, 409, 413, 503),
    )
    async def switch_branch(
        self,
        session_id: FromPath[str],
        data: JSONBody[SwitchBranch],
        services: ServicesDep,
        tenant: TenantDep,
    ) -> MessageList:
        """The next turn continues the new active branch: from ``message_id``, the
        newest message at every step down to its end. Answers that branch."""

        async def write(lock, write_id):
            return await services.store.switch_branch(
                tenant.id, session_id, data.message_id, lock=lock, write_id=write_id
            )

        await locked_write(services, tenant, session_id, write)
        return branch_view(session_id, await read_branch(services, tenant, session_id))

    @delete(
        "/messages/{message_id:str}",
        summary="Delete a message and everything after it on every branch through it",
        status_code=204,
        responses=documented_errors(400, 401, 404, 409, 503),
    )
    async def delete_branch(
        self,
        session_id: FromPath[str],
        message_id: FromPath[str],
        services: ServicesDep,
        tenant: TenantDep,
    ) -> None:
        """Messages other branches use stay. If the active branch went, its parent's
        newest remaining continuation becomes active."""

        await delete_with_kv(
            services,
            tenant,
            session_id,
            lambda lock, write_id: services.store.delete_branch(
                tenant.id, session_id, message_id, lock=lock, write_id=write_id
            ),
        )
