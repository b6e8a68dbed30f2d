"""System prompts: a tenant's own (private) ones, and the shared ones every tenant may use.

Who may share: only the operator (``/admin/system-prompts``, see admin.py). A
shared prompt's text is readable by every tenant and its KV blocks are public,
so letting a tenant publish one would let it turn another tenant's identical
text public and watch its cache hits. Tenants create, read and delete their
private prompts here, and read the shared ones.
"""

from __future__ import annotations

from litestar import Controller, delete, get, post
from litestar.params import FromPath, JSONBody

from chatsvc.api.native.schemas import CreateSystemPrompt, SystemPromptList, SystemPromptView
from chatsvc.api.shared.deps import ServicesDep, TenantDep
from chatsvc.api.shared.errors import (
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    documented_errors,
)
from chatsvc.api.shared.rendering import check_text, system_prefix_tokens
from chatsvc.api.shared.store_access import UNKNOWN_PROMPT, visible_prompt
from chatsvc.store.errors import InvalidInputError, LimitExceededError
from chatsvc.store.records import SystemPromptRecord


def prompt_view(prompt: SystemPromptRecord) -> SystemPromptView:
    return SystemPromptView(
        id=prompt.id,
        name=prompt.name,
        text=prompt.text,
        shared=prompt.shared,
        num_tokens=len(prompt.token_ids),
        created_at=prompt.created_at,
    )


class SystemPromptController(Controller):
    path = "/system-prompts"
    tags = ["system prompts"]

    @post(
        "/",
        summary="Register a private system prompt",
        status_code=201,
        responses=documented_errors(400, 401, 403, 413, 429, 503),
    )
    async def create_prompt(
        self, data: JSONBody[CreateSystemPrompt], services: ServicesDep, tenant: TenantDep
    ) -> SystemPromptView:
        """The prompt is the tenant's own: no other tenant sees it or shares its KV.
        ``shared: true`` answers 403: shared prompts are published by the operator
        (``POST /admin/system-prompts``). 429 at ``CHATSVC_MAX_SYSTEM_PROMPTS_PER_TENANT``."""
        if data.shared:
            raise PermissionDeniedError(
                "tenants cannot share system prompts: the operator publishes shared ones "
                "(POST /admin/system-prompts with the admin key)"
            )
        text = check_text(data.text, services, "system prompt")
        token_ids = await system_prefix_tokens(services, text)
        limit = services.settings.limits.max_system_prompts_per_tenant
        try:
            prompt = await services.store.prompts.create(
                tenant.id, data.name, text, token_ids, limit=limit
            )
        except LimitExceededError:
            raise RateLimitError(
                f"this tenant already has {limit} system prompts; delete some first"
            ) from None
        except InvalidInputError as exc:
            raise InvalidRequestError(str(exc)) from None
        return prompt_view(prompt)

    @get(
        "/",
        summary="The tenant's system prompts and every shared one",
        responses=documented_errors(400, 401, 503),
    )
    async def list_prompts(self, services: ServicesDep, tenant: TenantDep) -> SystemPromptList:
        prompts = await services.store.prompts.visible(tenant.id)
        return SystemPromptList(system_prompts=[prompt_view(p) for p in prompts])

    @get(
        "/{prompt_id:str}",
        summary="Read one system prompt",
        responses=documented_errors(400, 401, 404, 503),
    )
    async def read_prompt(
        self, prompt_id: FromPath[str], services: ServicesDep, tenant: TenantDep
    ) -> SystemPromptView:
        return prompt_view(await visible_prompt(services, tenant, prompt_id))

    @delete(
        "/{prompt_id:str}",
        summary="Delete one of the tenant's own system prompts",
        status_code=204,
        responses=documented_errors(400, 401, 403, 404, 503),
    )
    async def delete_prompt(
        self, prompt_id: FromPath[str], services: ServicesDep, tenant: TenantDep
    ) -> None:
        """Sessions started on the prompt keep working (they hold their own copy of
        it). A shared prompt answers 403 (the operator withdraws those); another
        tenant's prompt answers 404, exactly like an unknown id."""
        prompt = await visible_prompt(services, tenant, prompt_id)
        if prompt.shared:
            raise PermissionDeniedError(
                "shared system prompts are withdrawn by the operator "
                "(DELETE /admin/system-prompts/{id})"
            )
        if not await services.store.prompts.delete(tenant.id, prompt_id):
            raise NotFoundError(UNKNOWN_PROMPT)  # deleted by a concurrent request
