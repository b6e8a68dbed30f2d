"""``GET /v1/models`` and ``GET /v1/models/{id}``: the one model this server serves, and
the check every request's ``model`` field goes through."""

from __future__ import annotations

from litestar import Controller, get
from litestar.params import FromPath

from chatsvc.api.openai.schemas import Model, ModelList
from chatsvc.api.shared.deps import ServicesDep, TenantDep
from chatsvc.api.shared.errors import NotFoundError, documented_errors


class ModelsController(Controller):
    path = "/v1"
    tags = ["openai"]

    @get("/models", summary="The served model", responses=documented_errors(400, 401, 503))
    async def list_models(self, services: ServicesDep, tenant: TenantDep) -> ModelList:
        return ModelList(data=[_served(services)])

    @get(
        "/models/{model_id:str}",
        summary="The served model by its id (the openai SDK's models.retrieve)",
        responses=documented_errors(400, 401, 404, 503),
    )
    async def retrieve_model(
        self, model_id: FromPath[str], services: ServicesDep, tenant: TenantDep
    ) -> Model:
        check_model(services, model_id)
        return _served(services)


def _served(services: ServicesDep) -> Model:
    engine = services.engine
    return Model(
        id=engine.model_name,
        created=services.started,
        max_model_len=engine.max_context_len,
        kv_block_size=engine.info.block_size,
    )


def check_model(services: ServicesDep, model: str | None) -> None:
    """404 ``model_not_found`` unless ``model`` (when given) is the served one."""
    if model is not None and model != services.engine.model_name:
        raise NotFoundError(
            f"model {model!r} is not served here; GET /v1/models lists "
            f"{services.engine.model_name!r}",
            error_type="model_not_found",
        )
