"""``POST /v1/completions``: OpenAI's legacy text completions, as vLLM serves them.

The prompt is raw text (or token ids) that the model continues; no chat template
is applied, and text is tokenized as the model's tokenizer reads it (special
tokens spelled in it are special tokens: the client writes the whole prompt).
Each prompt of a list is its own engine request, all running at once; choice
``prompt_index * n + i`` is sample i of that prompt.

Prompt blocks are cached in the tenant's private namespace exactly like a chat's,
so a completion and a chat completion whose token ids agree reuse each other's KV.
``echo`` puts the prompt in front of the text; with ``logprobs`` it also scores
the prompt's tokens (what lm-evaluation-harness's loglikelihood tasks read), which
computes the whole prompt (a scored token's logits are not in the cache).
"""

from __future__ import annotations

import functools

import anyio
import msgspec
from litestar import Controller, MediaType, Response, post
from litestar.background_tasks import BackgroundTask
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import JSONBody
from litestar.response import ServerSentEvent

from chatsvc.api.openai import response_size
from chatsvc.api.openai.completion_output import CompletionOutput
from chatsvc.api.openai.completion_schemas import Completion, CompletionRequest
from chatsvc.api.openai.models import check_model
from chatsvc.api.openai.sampling_fields import build_sampling
from chatsvc.api.shared.deps import ServicesDep, TenantDep
from chatsvc.api.shared.errors import InvalidRequestError, documented_errors
from chatsvc.api.shared.generation import StreamSlot, new_request_id
from chatsvc.api.shared.openapi_streams import StreamingOperation
from chatsvc.api.shared.rendering import namespace_for
from chatsvc.api.shared.sampling import fit_context
from chatsvc.protocol import GenerationRequest, Tokenizer

# OpenAI's (and vLLM's) default for this endpoint.
DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 32


class Prompt(msgspec.Struct):
    """One prompt's tokens, and its text as given (None: sent as token ids)."""

    token_ids: list[int]
    text: str | None


class CompletionsController(Controller):
    path = "/v1"
    tags = ["openai"]

    @post(
        "/completions",
        summary="Text completion (OpenAI's legacy format)",
        status_code=200,
        operation_class=StreamingOperation,
        responses={
            200: ResponseSpec(
                Completion,
                description="With stream: true, text/event-stream of text_completion chunks "
                "ending with data: [DONE]",
                generate_examples=False,
            ),
            **documented_errors(400, 401, 404, 413, 429, 500, 503),
        },
    )
    async def completions(
        self, data: JSONBody[CompletionRequest], services: ServicesDep, tenant: TenantDep
    ) -> Response[Completion] | ServerSentEvent:
        """Non-streaming: one ``text_completion``. ``stream: true``: text_completion chunks
        ending with ``data: [DONE]``; usage in a last chunk with
        ``stream_options.include_usage``."""
        prompts, requests = await _build_requests(services, tenant, data)
        estimate = response_size.completion_bytes(
            requests, data.echo, data.logprobs, data.prompt_logprobs, data.stream
        )
        response_size.check_response_bytes(estimate, services.settings.limits.max_response_bytes)
        slot = StreamSlot(services, tenant.id)
        stream = CompletionOutput(services, data, prompts, requests, estimate)
        if data.stream:
            return ServerSentEvent(stream.chunks(slot), background=BackgroundTask(_release, slot))
        try:
            results = await stream.collect()
        finally:
            slot.release()
        return Response(await stream.encoded_response(results), media_type=MediaType.JSON)


async def _release(slot: StreamSlot) -> None:
    slot.release()


async def _build_requests(services: ServicesDep, tenant: TenantDep, data: CompletionRequest):
    check_model(services, data.model)
    if data.suffix is not None:
        raise InvalidRequestError("suffix is not supported: this server only appends to a prompt")
    prompts = await _prompts(services, data.prompt)
    logprobs = data.logprobs
    prompt_logprobs = data.prompt_logprobs
    if data.echo and logprobs is not None:
        prompt_logprobs = max(logprobs, prompt_logprobs or 0)
    sampling, requested = build_sampling(
        services, data, data.max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs
    )
    namespace = namespace_for(tenant, 0)
    base_id = new_request_id("cmpl")
    requests = []
    for i, prompt in enumerate(prompts):
        fitted = fit_context(
            services, len(prompt.token_ids), sampling, requested, DEFAULT_MAX_TOKENS
        )
        request = GenerationRequest(
            request_id=f"{base_id}-{i}",
            prompt_token_ids=prompt.token_ids,
            sampling=fitted,
            namespace=namespace,
            labels={"tenant": tenant.id},
        )
        try:
            request.validate(services.engine.vocab_size)
        except ValueError as exc:
            raise InvalidRequestError(f"prompt {i}: {exc}") from None
        requests.append(request)
    return prompts, requests


async def _prompts(services: ServicesDep, prompt) -> list[Prompt]:
    """The request's prompts as token ids; 400 on an empty, mixed or oversized prompt."""
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise InvalidRequestError("prompt must not be empty")
    if len(items) > MAX_PROMPTS:
        raise InvalidRequestError(f"prompt holds {len(items)} prompts; the limit is {MAX_PROMPTS}")
    texts = [p for p in items if isinstance(p, str)]
    if texts and len(texts) != len(items):
        raise InvalidRequestError(
            "prompt must be a string, a list of strings, a list of token ids, "
            "or a list of lists of token ids"
        )
    total = sum(len(t) for t in texts)
    if total > services.settings.limits.max_message_chars * 4:
        raise InvalidRequestError(f"the prompts hold {total} characters; too long")
    if texts:
        encode = functools.partial(encode_text, services.engine.tokenizer, add_special_tokens=True)
        ids = await anyio.to_thread.run_sync(lambda: [encode(t) for t in texts])
        prompts = [Prompt(token_ids, text) for token_ids, text in zip(ids, texts, strict=True)]
    else:
        if not all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in items):
            raise InvalidRequestError(
                "prompt must be a string, a list of strings, a list of token ids, "
                "or a list of lists of token ids"
            )
        prompts = [Prompt(list(p), None) for p in items]
    for i, p in enumerate(prompts):
        if not p.token_ids:
            raise InvalidRequestError(f"prompt {i} is empty")
    return prompts


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The tokenizer's own ids of a raw text (what vLLM's completions and /tokenize use)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
