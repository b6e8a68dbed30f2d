"""``GET /v1/models``: the one model this server serves, and the check every request's
``model`` field goes through."""

from __future__ import annotations

from litestar import Controller, get

from chatsvc.api.openai.schemas import Model, ModelList
from chatsvc.api.shared.deps import ServicesDep, TenantDep
from chatsvc.api.shared.errors import NotFoundError, documented_errors


class ModelsController(Controller):
    path = "/v1"
    tags = ["openai"]

    @get("/models", summary="The served model", responses=documented_errors(400, 401, 503))
    async def list_models(self, services: ServicesDep, tenant: TenantDep) -> ModelList:
        engine = services.engine
        model = Model(
            id=engine.model_name,
            created=services.started,
            max_model_len=engine.max_context_len,
            kv_block_size=engine.info.block_size,
        )
        return ModelList(data=[model])


def check_model(services: ServicesDep, model: str | None) -> None:
    """404 ``model_not_found`` unless ``model`` (when given) is the served one."""
    if model is not None and model != services.engine.model_name:
        raise NotFoundError(
            f"model {model!r} is not served here; GET /v1/models lists "
            f"{services.engine.model_name!r}",
            error_type="model_not_found",
        )
