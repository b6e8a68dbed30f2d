"""System prompts: a tenant's own, and shared ones every tenant may use."""

from __future__ import annotations

from litestar import Controller, get, post
from litestar.params import FromPath, JSONBody

from chatsvc.api import generation as gen
from chatsvc.api.deps import ServicesDep, TenantDep
from chatsvc.api.errors import InvalidRequestError, NotFoundError, documented_errors
from chatsvc.api.schemas import CreateSystemPrompt, SystemPromptList, SystemPromptView
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
        summary="Register a system prompt",
        status_code=201,
        responses=documented_errors(400, 401, 413, 503),
    )
    async def create_prompt(
        self, data: JSONBody[CreateSystemPrompt], services: ServicesDep, tenant: TenantDep
    ) -> SystemPromptView:
        """A ``shared`` prompt is visible to every tenant, and the KV blocks of its
        tokens are shared across tenants: put nothing secret in it."""
        text = gen.check_text(data.text, services, "system prompt")
        token_ids = await gen.system_prefix_tokens(services, text)
        try:
            prompt = await services.store.create_system_prompt(
                tenant.id, data.name, text, token_ids, data.shared
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        return prompt_view(prompt)

    @get(
        "/",
        summary="The tenant's system prompts and every shared one",
        responses=documented_errors(400, 401, 503),
    )
    async def list_prompts(self, services: ServicesDep, tenant: TenantDep) -> SystemPromptList:
        prompts = await services.store.list_system_prompts(tenant.id)
        return SystemPromptList(system_prompts=[prompt_view(p) for p in prompts])

    @get(
        "/{prompt_id:str}",
        summary="Read one system prompt",
        responses=documented_errors(400, 401, 404, 503),
    )
    async def read_prompt(
        self, prompt_id: FromPath[str], services: ServicesDep, tenant: TenantDep
    ) -> SystemPromptView:
        try:
            prompt = await services.store.get_system_prompt(tenant.id, prompt_id)
        except ValueError:
            prompt = None
        if prompt is None:
            raise NotFoundError("no such system prompt")
        return prompt_view(prompt)
