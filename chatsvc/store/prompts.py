"""System prompts: each tenant's private ones, and the shared ones the operator publishes.

Sharing is the operator's decision alone: a shared prompt's KV blocks hash in
the public namespace and every tenant reads its text, so a tenant that could
publish one could make another tenant's identical text public (and then see
its cache hits). Tenants therefore own only private prompts; shared ones have
no tenant (``tenant_id`` None) and live in ``p:prompts:shared``.

Both kinds are capped at creation: the count and the write happen in one
WATCHed transaction on the owner's index, so racing creates cannot pass the cap.
"""

from __future__ import annotations

import secrets

import redis.exceptions as rexc

from chatsvc.store import validate as v
from chatsvc.store.connection import is_transport_error
from chatsvc.store.context import MAX_WATCH_RETRIES, StoreContext
from chatsvc.store.errors import (
    InvalidInputError,
    InvalidInputTypeError,
    LimitExceededError,
    StoreError,
    StoreUnavailableError,
)
from chatsvc.store.keys import check_id
from chatsvc.store.records import SystemPromptRecord, decode, encode, now
from chatsvc.store.tenants import Tenants


class Prompts:
    """``store.prompts``: tenants' private system prompts and the operator's shared ones."""

    def __init__(self, context: StoreContext, tenants: Tenants) -> None:
        self._ctx = context
        self._tenants = tenants

    async def create(
        self,
        tenant_id: str,
        name: str,
        text: str,
        token_ids: list[int],
        shared: bool = False,
        *,
        limit: int | None = None,
    ) -> SystemPromptRecord:
        """Store a private system prompt owned by ``tenant_id``.

        ``shared`` must be False: a tenant cannot share (see the module doc and
        ``create_shared``). ``limit``: the most prompts the tenant may
        own; at the limit, raises ``LimitExceededError``. Raises ``NotFoundError``
        for an unknown tenant.
        """
        if not isinstance(shared, bool):
            raise InvalidInputTypeError(f"shared must be a bool, got {type(shared).__name__}")
        if shared:
            raise InvalidInputError(
                "a tenant's system prompt cannot be shared; the operator publishes"
            )
        check_id("tenant", tenant_id)
        prompt = _new_prompt(tenant_id, name, text, token_ids)
        with self._ctx.unavailable():
            await self._tenants.require(tenant_id)
            await self._insert(prompt, self._ctx.keys.tenant_prompts(tenant_id), limit)
        return prompt

    async def create_shared(
        self, name: str, text: str, token_ids: list[int], *, limit: int | None = None
    ) -> SystemPromptRecord:
        """Publish a shared system prompt (an operator action): every tenant can read it.

        ``limit``: the most shared prompts there may be; at it, ``LimitExceededError``.
        """
        prompt = _new_prompt(None, name, text, token_ids)
        with self._ctx.unavailable():
            await self._insert(prompt, self._ctx.keys.shared_prompts(), limit)
        return prompt

    async def get(self, tenant_id: str, prompt_id: str) -> SystemPromptRecord | None:
        """The prompt if ``tenant_id`` owns it or it is shared; else None."""
        check_id("tenant", tenant_id)
        check_id("system prompt", prompt_id)
        with self._ctx.unavailable():
            raw = await self._ctx.redis.get(self._ctx.keys.prompt(prompt_id))
        if raw is None:
            return None
        prompt = decode(SystemPromptRecord, raw)
        return prompt if prompt.shared or prompt.tenant_id == tenant_id else None

    async def visible(self, tenant_id: str) -> list[SystemPromptRecord]:
        """The tenant's own prompts and every shared one, oldest first."""
        check_id("tenant", tenant_id)
        keys = self._ctx.keys
        with self._ctx.unavailable():
            own, shared = keys.tenant_prompts(tenant_id), keys.shared_prompts()
            ids = await self._ctx.redis.sunion([own, shared])
            return await self._load_prompts(ids)

    async def all_shared(self) -> list[SystemPromptRecord]:
        """Every shared prompt, oldest first."""
        with self._ctx.unavailable():
            ids = await self._ctx.redis.smembers(self._ctx.keys.shared_prompts())
            return await self._load_prompts(ids)

    async def delete(self, tenant_id: str, prompt_id: str) -> bool:
        """Delete the tenant's own prompt; False if it is not one (unknown, foreign or shared).

        Sessions started on it keep working: they hold their own copy of its
        text and tokens.
        """
        check_id("tenant", tenant_id)
        check_id("system prompt", prompt_id)
        with self._ctx.unavailable():
            return await self._delete(
                prompt_id,
                self._ctx.keys.tenant_prompts(tenant_id),
                lambda p: not p.shared and p.tenant_id == tenant_id,
            )

    async def delete_shared(self, prompt_id: str) -> bool:
        """Withdraw a shared prompt (an operator action); False if ``prompt_id`` is not one."""
        check_id("system prompt", prompt_id)
        with self._ctx.unavailable():
            return await self._delete(
                prompt_id,
                self._ctx.keys.shared_prompts(),
                lambda p: p.shared and p.tenant_id is None,
            )

    # -- helpers -------------------------------------------------------------

    async def _load_prompts(self, ids) -> list[SystemPromptRecord]:
        ordered = sorted(i.decode() for i in ids)
        keys = [self._ctx.keys.prompt(i) for i in ordered]
        raws = await self._ctx.redis.mget(keys) if ordered else []
        prompts = [decode(SystemPromptRecord, raw) for raw in raws if raw is not None]
        return sorted(prompts, key=lambda p: (p.created_at, p.id))

    async def _insert(self, prompt: SystemPromptRecord, index: str, limit: int | None) -> None:
        for _ in range(MAX_WATCH_RETRIES):
            async with self._ctx.redis.pipeline(transaction=True) as pipe:
                # WATCH the index: a rival create or delete between the count and
                # EXEC voids the EXEC, and the count is taken again.
                await pipe.watch(index)
                if limit is not None and await pipe.scard(index) >= limit:
                    raise LimitExceededError(f"at the limit of {limit} system prompts")
                pipe.multi()
                # Same id on every attempt: a replay after a lost reply rewrites
                # the same record and set member, so it adds nothing.
                pipe.set(self._ctx.keys.prompt(prompt.id), encode(prompt))
                pipe.sadd(index, prompt.id)
                try:
                    await pipe.execute()
                    return
                except rexc.WatchError as exc:
                    conflict = exc
        raise _gave_up("create", conflict)

    async def _delete(self, prompt_id: str, index: str, deletable) -> bool:
        key = self._ctx.keys.prompt(prompt_id)
        for _ in range(MAX_WATCH_RETRIES):
            async with self._ctx.redis.pipeline(transaction=True) as pipe:
                await pipe.watch(key)
                raw = await pipe.get(key)
                if raw is None or not deletable(decode(SystemPromptRecord, raw)):
                    return False
                pipe.multi()
                pipe.delete(key)
                pipe.srem(index, prompt_id)
                try:
                    await pipe.execute()
                    return True
                except rexc.WatchError as exc:
                    conflict = exc
        raise _gave_up("delete", conflict)


def _new_prompt(
    tenant_id: str | None, name: str, text: str, token_ids: list[int]
) -> SystemPromptRecord:
    v.check_name("name", name)
    v.check_text("text", text, allow_empty=False)
    return SystemPromptRecord(
        id=secrets.token_hex(16),
        tenant_id=tenant_id,
        name=name,
        text=text,
        token_ids=v.check_token_ids("token_ids", token_ids),
        shared=tenant_id is None,
        created_at=now(),
    )


def _gave_up(action: str, conflict: rexc.WatchError) -> StoreError:
    # As in sessions: a WatchError raised from a lost connection is an outage.
    if is_transport_error(conflict.__context__):
        return StoreUnavailableError(
            f"lost the connection to redis during a system prompt {action}; nothing was written"
        )
    return StoreError(f"system prompts kept changing during {action}; try again")
