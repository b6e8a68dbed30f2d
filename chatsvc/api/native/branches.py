"""A session's branches in the native API: switch the active one, delete one.

A session's messages form a tree (chatsvc/store/tree.py): regenerating an
answer or editing a message adds a sibling, and the new branch becomes the
active one. ``GET /sessions/{id}/messages`` shows a branch with each message's
siblings; the routes here move the active branch and remove branches. Both
take the session's turn lock, so they never run beside a turn (409).
"""

from __future__ import annotations

from litestar import Controller, delete, put
from litestar.params import FromPath, JSONBody

from chatsvc.api.native.schemas import MessageList, MessageView, SwitchBranch
from chatsvc.api.shared.deps import ServicesDep, TenantDep
from chatsvc.api.shared.errors import documented_errors
from chatsvc.api.shared.session_kv import delete_with_kv
from chatsvc.api.shared.store_access import locked_write, read_branch
from chatsvc.store.branch_read import Branch
from chatsvc.store.records import MessageRecord


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
            return await services.store.branches.switch(
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
            lambda lock, write_id: services.store.branches.delete(
                tenant.id, session_id, message_id, lock=lock, write_id=write_id
            ),
        )
