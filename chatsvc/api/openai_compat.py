"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/models``.

Stateless: the client sends the whole conversation each time, and the prefix
cache (not a session) makes the repeated part cheap. A request that names a
shared system prompt by ``system_prompt_id`` hashes that prompt's blocks in the
public namespace, exactly as a session on that prompt would; a system message
sent as text is private whatever it says.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
from litestar import Controller, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import JSONBody
from litestar.response import ServerSentEvent

from chatsvc.api import generation as gen
from chatsvc.api.caller_ids import affinity_headers, check_caller_ids, log_caller_ids
from chatsvc.api.deps import ServicesDep, TenantDep
from chatsvc.api.errors import (
    ApiError,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
    documented_errors,
    error_body,
)
from chatsvc.api.openai_schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    ChunkDelta,
    CompletionUsage,
    Model,
    ModelList,
    PromptTokensDetails,
)
from chatsvc.api.openapi_streams import StreamingOperation
from chatsvc.api.system_prompts import named_system_prompt

ENDPOINT = "chat_completions"


class OpenAIController(Controller):
    path = "/v1"
    tags = ["openai"]

    @get("/models", summary="The served model", responses=documented_errors(400, 401, 503))
    async def list_models(self, services: ServicesDep, tenant: TenantDep) -> ModelList:
        return ModelList(data=[Model(id=services.engine.model_name, created=services.started)])

    @post(
        "/chat/completions",
        summary="Chat completion (OpenAI format)",
        operation_class=StreamingOperation,
        status_code=200,
        responses={
            200: ResponseSpec(
                ChatCompletion,
                description="With stream: true, text/event-stream of chat.completion.chunk "
                "objects ending with data: [DONE]",
                generate_examples=False,
            ),
            **documented_errors(400, 401, 404, 413, 429, 500, 503),
        },
    )
    async def chat_completions(
        self, data: JSONBody[ChatCompletionRequest], services: ServicesDep, tenant: TenantDep
    ) -> Response[ChatCompletion] | ServerSentEvent:
        """Non-streaming: one ChatCompletion. ``stream: true``: chat.completion.chunk
        events ending with ``data: [DONE]``; usage in a last chunk with
        ``stream_options.include_usage``."""
        check_caller_ids(data.prompt_cache_key, data.user, data.safety_identifier)
        request = await _build_request(services, tenant, data)
        slot = gen.StreamSlot(services, tenant.id)
        completion_id = gen.new_request_id("chatcmpl")
        log_caller_ids(
            ENDPOINT, completion_id, data.prompt_cache_key, data.user, data.safety_identifier
        )
        headers = affinity_headers(data.prompt_cache_key)
        created = int(time.time())
        if data.stream:
            include_usage = data.stream_options is not None and data.stream_options.include_usage
            chunks = _stream(services, request, slot, completion_id, created, include_usage)
            return ServerSentEvent(
                chunks, background=BackgroundTask(_release, slot), headers=headers
            )
        try:
            samples = await _collect(services, request)
        finally:
            slot.release()
        completion = ChatCompletion(
            id=completion_id,
            created=created,
            model=services.engine.model_name,
            choices=[
                Choice(
                    index=i,
                    message=AssistantMessage(content=s.text),
                    finish_reason=s.finish_reason or "stop",
                )
                for i, s in enumerate(samples)
            ],
            usage=_usage(samples),
        )
        return Response(completion, headers=headers)


async def _release(slot: gen.StreamSlot) -> None:
    # Covers a stream that never started (client gone before the first byte).
    slot.release()


async def _build_request(
    services: ServicesDep, tenant: TenantDep, data: JSONBody[ChatCompletionRequest]
):
    from chatsvc.engine import GenerationRequest

    if data.model != services.engine.model_name:
        raise NotFoundError(
            f"model {data.model!r} is not served here; GET /v1/models lists "
            f"{services.engine.model_name!r}",
            error_type="model_not_found",
        )
    if not data.messages:
        raise InvalidRequestError("messages must not be empty")
    max_messages = services.settings.limits.max_messages
    if len(data.messages) > max_messages:
        raise InvalidRequestError(
            f"the request has {len(data.messages)} messages; the limit is {max_messages}"
        )
    if data.presence_penalty != 0 or data.frequency_penalty != 0 or data.logprobs:
        raise InvalidRequestError("presence/frequency penalties and logprobs are not supported")
    if data.max_tokens is not None and data.max_completion_tokens is not None:
        raise InvalidRequestError("give max_tokens or max_completion_tokens, not both")
    messages = []
    for m in data.messages:
        role = "system" if m.role == "developer" else m.role
        messages.append({"role": role, "content": m.text()})
    system = await named_system_prompt(services, tenant, data.system_prompt_id, messages)
    if messages[-1]["role"] == "assistant":
        raise InvalidRequestError("the last message must not be the assistant's")
    total = sum(len(m["content"]) for m in messages)
    if total > services.settings.limits.max_message_chars * 4:
        raise InvalidRequestError(f"the messages hold {total} characters; too long")
    requested = data.max_completion_tokens if data.max_tokens is None else data.max_tokens
    sampling, requested = gen.build_sampling(
        services,
        max_tokens=requested,
        temperature=data.temperature,
        top_p=data.top_p,
        top_k=data.top_k,
        seed=data.seed,
        stop=data.stop_list(),
        n=data.n,
    )
    prompt = await gen.format_chat(services.engine.chat_format.render, messages)
    sampling = gen.fit_context(services, len(prompt), sampling, requested)
    labels = {"tenant": tenant.id}
    if system is not None:
        labels["system_prompt"] = system.id
    return GenerationRequest(
        request_id=gen.new_request_id("chat"),
        prompt_token_ids=prompt,
        sampling=sampling,
        namespace=gen.namespace_for(tenant, gen.shared_prefix_len(prompt, system)),
        labels=labels,
    )


async def _collect(services: ServicesDep, request) -> list[gen.SampleResult]:
    samples = [gen.SampleResult() for _ in range(request.sampling.n)]
    async for delta in gen.generate(services, request):
        sample = samples[delta.index]
        sample.text += delta.text
        sample.token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            sample.finish_reason = delta.finish_reason
            sample.metrics = delta.metrics
    _check_finished(services, samples)
    gen.record_finished(services, ENDPOINT, request.labels, samples)
    return samples


def _check_finished(services: ServicesDep, samples: list[gen.SampleResult]) -> None:
    # The same answer as the native path's for an aborted generation: 503, retry later.
    if any(s.finish_reason in (None, "abort") for s in samples):
        services.metrics.observe_failure(ENDPOINT, "aborted")
        raise ServiceUnavailableError("the generation was aborted")


def _usage(samples: list[gen.SampleResult]) -> CompletionUsage:
    first = samples[0].metrics
    prompt = first.prompt_tokens if first is not None else 0
    cached = first.cached_prompt_tokens if first is not None else 0
    completion = sum(s.metrics.completion_tokens for s in samples if s.metrics is not None)
    return CompletionUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


async def _stream(
    services: ServicesDep, request, slot, completion_id: str, created: int, include_usage: bool
) -> AsyncIterator[str]:
    model = services.engine.model_name

    def chunk(choices: list[ChunkChoice], usage: CompletionUsage | None = None) -> str:
        body = ChatCompletionChunk(
            id=completion_id, created=created, model=model, choices=choices, usage=usage
        )
        return msgspec.json.encode(body).decode()

    samples = [gen.SampleResult() for _ in range(request.sampling.n)]
    try:
        # The role comes first, alone, as in OpenAI's own streams.
        yield chunk(
            [
                ChunkChoice(index=i, delta=ChunkDelta(role="assistant", content=""))
                for i in range(len(samples))
            ]
        )
        async for delta in gen.generate(services, request):
            sample = samples[delta.index]
            sample.text += delta.text
            if delta.finish_reason is not None:
                sample.finish_reason = delta.finish_reason
                sample.metrics = delta.metrics
            if delta.text or delta.finish_reason is not None:
                piece = ChunkDelta(content=delta.text) if delta.text else ChunkDelta()
                yield chunk(
                    [ChunkChoice(index=delta.index, delta=piece, finish_reason=delta.finish_reason)]
                )
        _check_finished(services, samples)
        gen.record_finished(services, ENDPOINT, request.labels, samples)
        if include_usage:
            yield chunk([], usage=_usage(samples))
        yield "[DONE]"
    except ApiError as exc:
        yield msgspec.json.encode(error_body(exc.error_type, exc.message)).decode()
    finally:
        slot.release()
