"""OpenAI-compatible ``POST /v1/chat/completions`` (text completions: ``completions.py``).

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
from litestar import Controller, MediaType, Response, post
from litestar.background_tasks import BackgroundTask
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import JSONBody
from litestar.response import ServerSentEvent

from chatsvc.api.openai import response_size
from chatsvc.api.openai.caller_ids import affinity_headers, check_caller_ids, log_caller_ids
from chatsvc.api.openai.logprob_views import chat_logprobs, token_texts
from chatsvc.api.openai.models import check_model
from chatsvc.api.openai.sampling_fields import build_sampling
from chatsvc.api.openai.schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    Choice,
    ChunkChoice,
    ChunkDelta,
    CompletionUsage,
    PromptTokensDetails,
)
from chatsvc.api.shared.deps import ServicesDep, TenantDep
from chatsvc.api.shared.errors import (
    ApiError,
    InvalidRequestError,
    ServiceUnavailableError,
    documented_errors,
    error_body,
)
from chatsvc.api.shared.generation import (
    SampleResult,
    StreamSlot,
    generate,
    new_request_id,
    record_finished,
)
from chatsvc.api.shared.openapi_streams import StreamingOperation
from chatsvc.api.shared.rendering import format_chat, namespace_for, shared_prefix_len
from chatsvc.api.shared.sampling import fit_context
from chatsvc.api.shared.store_access import visible_prompt
from chatsvc.protocol import GenerationRequest
from chatsvc.service import Services
from chatsvc.store.records import SystemPromptRecord, TenantRecord
from chatsvc.store.validate import check_metadata

ENDPOINT = "chat_completions"


class ChatCompletionsController(Controller):
    path = "/v1"
    tags = ["openai"]

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
        ``stream_options.include_usage``. ``beam_width`` (extension): beam search, the
        ``n`` best beams as the choices, best first; streamed, each comes whole at the
        end (the best beams are known only when the search ends)."""
        check_caller_ids(data.prompt_cache_key, data.user, data.safety_identifier)
        request = await _build_request(services, tenant, data)
        estimate = response_size.chat_completion_bytes(request, data.stream)
        response_size.check_response_bytes(estimate, services.settings.limits.max_response_bytes)
        slot = StreamSlot(services, tenant.id)
        completion_id = new_request_id("chatcmpl")
        log_caller_ids(
            ENDPOINT, completion_id, data.prompt_cache_key, data.user, data.safety_identifier
        )
        headers = affinity_headers(data.prompt_cache_key)
        created = int(time.time())
        if data.stream:
            chunks = _stream(services, request, slot, completion_id, created, data.include_usage)
            return ServerSentEvent(
                chunks, background=BackgroundTask(_release, slot), headers=headers
            )
        try:
            samples = await _collect(services, request)
        finally:
            slot.release()
        texts = token_texts(services.engine.tokenizer)
        wants_logprobs = request.sampling.logprobs is not None

        def answer() -> bytes:
            completion = ChatCompletion(
                id=completion_id,
                created=created,
                model=services.engine.model_name,
                choices=[
                    Choice(
                        index=i,
                        message=AssistantMessage(content=s.text),
                        finish_reason=s.finish_reason or "stop",
                        logprobs=chat_logprobs(texts, s.logprobs) if wants_logprobs else None,
                    )
                    for i, s in enumerate(samples)
                ],
                usage=_usage(samples),
            )
            return response_size.encode_answer(completion)

        body = await response_size.off_loop(answer, estimate)
        return Response(body, headers=headers, media_type=MediaType.JSON)


async def _release(slot: StreamSlot) -> None:
    # Covers a stream that never started (client gone before the first byte).
    slot.release()


def template_messages(services: ServicesDep, messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The request's messages as the chat template takes them; 400 past the limits or
    for a message field asking what is not done here."""
    if not messages:
        raise InvalidRequestError("messages must not be empty")
    max_messages = services.settings.limits.max_messages
    if len(messages) > max_messages:
        raise InvalidRequestError(
            f"the request has {len(messages)} messages; the limit is {max_messages}"
        )
    refused = [
        f"messages[{i}].{what}" for i, m in enumerate(messages) for what in m.refused_fields()
    ]
    if refused:
        raise InvalidRequestError(f"not supported here: {'; '.join(refused)}")
    converted = [m.for_template() for m in messages]
    total = sum(len(m["content"]) for m in converted)
    if total > services.settings.limits.max_message_chars * 4:
        raise InvalidRequestError(f"the messages hold {total} characters; too long")
    return converted


async def render_prompt(
    services: Services,
    messages: list[dict[str, str]],
    add_generation_prompt: bool | None,
    continue_final_message: bool,
) -> list[int]:
    """The prompt's token ids, as vLLM's chat extensions ask: by default the template's
    generation prompt opens the answer's turn; ``continue_final_message`` leaves the
    final message (the assistant's) open and the answer continues it;
    ``add_generation_prompt: false`` alone ends the prompt with the last message."""
    chat_format = services.engine.chat_format
    last = messages[-1]["role"]
    if continue_final_message:
        if add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        if last != "assistant":
            raise InvalidRequestError(
                "continue_final_message continues the assistant's message: the last "
                f"message is the {last}'s"
            )
        return await format_chat(chat_format.render_continuation, messages)
    generation_prompt = add_generation_prompt is not False
    return await format_chat(chat_format.render, messages, generation_prompt)


async def named_system_prompt(
    services: Services, tenant: TenantRecord, prompt_id: str | None, messages: list[dict]
) -> SystemPromptRecord | None:
    """The prompt an OpenAI-style request names by ``system_prompt_id`` (None: none named).

    Its text becomes the leading system message of ``messages`` (role/content
    dicts, changed in place), unless they already start with a system message
    of exactly that text; a leading system message with other text is a 400,
    since the request would then hold two system prompts. 404 for an id the
    tenant cannot see.
    """
    if prompt_id is None:
        return None
    prompt = await visible_prompt(services, tenant, prompt_id)
    if messages and messages[0]["role"] == "system":
        if messages[0]["content"] != prompt.text:
            raise InvalidRequestError(
                "the leading system message is not the text of system_prompt_id; "
                "send one or the other"
            )
    else:
        messages.insert(0, {"role": "system", "content": prompt.text})
    return prompt


def _logprobs_of(data: ChatCompletionRequest) -> int | None:
    """The engine's ``logprobs`` (None = off) from OpenAI's logprobs / top_logprobs."""
    if data.top_logprobs and not data.logprobs:  # 0 asks for nothing (vLLM: the same)
        raise InvalidRequestError("top_logprobs needs logprobs: true")
    if not data.logprobs:
        return None
    return 0 if data.top_logprobs is None else data.top_logprobs


async def _build_request(
    services: ServicesDep, tenant: TenantDep, data: JSONBody[ChatCompletionRequest]
) -> GenerationRequest:
    check_model(services, data.model)
    refused = data.refused_fields()
    if refused:
        raise InvalidRequestError(f"not supported here: {'; '.join(refused)}")
    try:
        check_metadata(data.metadata)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(str(exc)) from None
    if data.max_tokens is not None and data.max_completion_tokens is not None:
        raise InvalidRequestError("give max_tokens or max_completion_tokens, not both")
    messages = template_messages(services, data.messages)
    system = await named_system_prompt(services, tenant, data.system_prompt_id, messages)
    if messages[-1]["role"] == "assistant" and not data.continue_final_message:
        raise InvalidRequestError(
            "the last message must not be the assistant's (to continue it, send "
            "continue_final_message: true)"
        )
    requested = data.max_completion_tokens if data.max_tokens is None else data.max_tokens
    sampling, requested = build_sampling(
        services,
        data,
        requested,
        logprobs=_logprobs_of(data),
        beam_width=data.beam_width,
        length_penalty=data.length_penalty,
        early_stopping=data.early_stopping,
    )
    prompt = await render_prompt(
        services, messages, data.add_generation_prompt, data.continue_final_message
    )
    sampling = fit_context(services, len(prompt), sampling, requested)
    labels = {"tenant": tenant.id}
    if system is not None:
        labels["system_prompt"] = system.id
    return GenerationRequest(
        request_id=new_request_id("chat"),
        prompt_token_ids=prompt,
        sampling=sampling,
        namespace=namespace_for(tenant, shared_prefix_len(prompt, system)),
        labels=labels,
    )


async def _collect(services: ServicesDep, request: GenerationRequest) -> list[SampleResult]:
    samples = [SampleResult() for _ in range(request.sampling.n)]
    async for delta in generate(services, request):
        samples[delta.index].add(delta)
    _check_finished(services, samples)
    record_finished(services, ENDPOINT, request.labels, samples)
    return samples


def _check_finished(services: ServicesDep, samples: list[SampleResult]) -> None:
    # The same answer as the native path's for an aborted generation: 503, retry later.
    if not all(s.finished for s in samples):
        services.metrics.observe_failure(ENDPOINT, "aborted")
        raise ServiceUnavailableError("the generation was aborted")


def _usage(samples: list[SampleResult]) -> CompletionUsage:
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
    services: ServicesDep,
    request: GenerationRequest,
    slot: StreamSlot,
    completion_id: str,
    created: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    model = services.engine.model_name

    def chunk(choices: list[ChunkChoice], usage: CompletionUsage | None = None) -> str:
        body = ChatCompletionChunk(
            id=completion_id, created=created, model=model, choices=choices, usage=usage
        )
        return msgspec.json.encode(body).decode()

    samples = [SampleResult() for _ in range(request.sampling.n)]
    texts = token_texts(services.engine.tokenizer)
    try:
        # The role comes first, alone, as in OpenAI's own streams.
        yield chunk(
            [
                ChunkChoice(index=i, delta=ChunkDelta(role="assistant", content=""))
                for i in range(len(samples))
            ]
        )
        async for delta in generate(services, request):
            samples[delta.index].add(delta)
            if delta.text or delta.finish_reason is not None or delta.logprobs:
                piece = ChunkDelta(content=delta.text) if delta.text else ChunkDelta()
                scores = chat_logprobs(texts, delta.logprobs) if delta.logprobs else None
                choice = ChunkChoice(
                    index=delta.index,
                    delta=piece,
                    finish_reason=delta.finish_reason,
                    logprobs=scores,
                )
                yield chunk([choice])
        _check_finished(services, samples)
        record_finished(services, ENDPOINT, request.labels, samples)
        if include_usage:
            yield chunk([], usage=_usage(samples))
        yield "[DONE]"
    except ApiError as exc:
        yield msgspec.json.encode(error_body(exc.error_type, exc.message)).decode()
    finally:
        slot.release()
