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

import asyncio
import functools
import time
from collections.abc import AsyncIterator

import anyio
import msgspec
from litestar import Controller, Response, post
from litestar.background_tasks import BackgroundTask
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import JSONBody
from litestar.response import ServerSentEvent

from chatsvc.api import generation as gen
from chatsvc.api.completion_schemas import Completion, CompletionChoice, CompletionRequest
from chatsvc.api.deps import ServicesDep, TenantDep
from chatsvc.api.errors import (
    ApiError,
    InvalidRequestError,
    ServiceUnavailableError,
    documented_errors,
    error_body,
)
from chatsvc.api.logprob_views import CompletionLogprobsBuilder, prompt_logprob_dicts, token_texts
from chatsvc.api.openai_compat import check_model
from chatsvc.api.openai_sampling import build_sampling
from chatsvc.api.openai_schemas import CompletionUsage, PromptTokensDetails

ENDPOINT = "completions"
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
        slot = gen.StreamSlot(services, tenant.id)
        stream = _Completion(services, data, prompts, requests)
        if data.stream:
            return ServerSentEvent(stream.chunks(slot), background=BackgroundTask(_release, slot))
        try:
            results = await stream.collect()
        finally:
            slot.release()
        return Response(stream.response(results))


async def _release(slot: gen.StreamSlot) -> None:
    slot.release()


async def _build_requests(services: ServicesDep, tenant: TenantDep, data: CompletionRequest):
    from chatsvc.engine import GenerationRequest

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
    namespace = gen.namespace_for(tenant, 0)
    base_id = gen.new_request_id("cmpl")
    requests = []
    for i, prompt in enumerate(prompts):
        fitted = gen.fit_context(
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


def encode_text(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The tokenizer's own ids of a raw text (what vLLM's completions and /tokenize use)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


class _Completion:
    """One completions request's engine requests, and how their output becomes choices."""

    def __init__(self, services, data: CompletionRequest, prompts: list[Prompt], requests):
        self.services = services
        self.data = data
        self.prompts = prompts
        self.requests = requests
        self.n = requests[0].sampling.n
        self.id = gen.new_request_id("cmpl")
        self.created = int(time.time())
        self.model = services.engine.model_name
        self.texts = token_texts(services.engine.tokenizer)
        self.wants_logprobs = data.logprobs is not None
        self.wants_prompt_logprobs = data.prompt_logprobs is not None
        self.samples = [[gen.SampleResult() for _ in range(self.n)] for _ in prompts]
        self.builders = [
            CompletionLogprobsBuilder(self.texts) for _ in range(len(prompts) * self.n)
        ]

    def _echo_text(self, index: int) -> str:
        prompt = self.prompts[index]
        if prompt.text is not None:
            return prompt.text
        return self.services.engine.chat_format.decode(prompt.token_ids)

    async def collect(self) -> list[list[gen.SampleResult]]:
        async for which, delta in self._deltas():
            self.samples[which][delta.index].add(delta)
        self._finish()
        return self.samples

    def _finish(self) -> None:
        for request, samples in zip(self.requests, self.samples, strict=True):
            if any(s.finish_reason in (None, "abort") for s in samples):
                self.services.metrics.observe_failure(ENDPOINT, "aborted")
                raise ServiceUnavailableError("the generation was aborted")
            gen.record_finished(self.services, ENDPOINT, request.labels, samples)

    def response(self, results: list[list[gen.SampleResult]]) -> Completion:
        choices = []
        for p, samples in enumerate(results):
            for i, sample in enumerate(samples):
                index = p * self.n + i
                text, logprobs = self._choice_parts(index, p, sample, sample.logprobs, True)
                choices.append(
                    CompletionChoice(
                        index=index,
                        text=text + sample.text,
                        logprobs=logprobs,
                        finish_reason=sample.finish_reason,
                        prompt_logprobs=self._prompt_entries(sample),
                    )
                )
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=self._usage()
        )

    def _choice_parts(self, index: int, p: int, sample, scores, first: bool):
        """The echoed prompt text (first piece only) and the logprobs of this piece."""
        echo = self._echo_text(p) if self.data.echo and first else ""
        if not self.wants_logprobs:
            return echo, None
        builder = self.builders[index]
        entries, ids = list(scores), None
        if echo and sample.prompt_logprobs is not None:
            entries = [*sample.prompt_logprobs, *entries]
            ids = [*self.prompts[p].token_ids, *(s.token_id for s in scores)]
        return echo, builder.build(entries, ids)

    def _prompt_entries(self, sample):
        if not self.wants_prompt_logprobs or sample.prompt_logprobs is None:
            return None
        return prompt_logprob_dicts(self.texts, sample.prompt_logprobs)

    def _usage(self) -> CompletionUsage:
        prompt = cached = completion = 0
        for samples in self.samples:
            first = samples[0].metrics
            if first is not None:
                prompt += first.prompt_tokens
                cached += first.cached_prompt_tokens
            completion += sum(s.metrics.completion_tokens for s in samples if s.metrics)
        return CompletionUsage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    async def chunks(self, slot: gen.StreamSlot) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], usage: CompletionUsage | None = None) -> str:
            body = Completion(
                id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
            )
            return msgspec.json.encode(body).decode()

        started: set[int] = set()
        try:
            async for p, delta in self._deltas():
                sample = self.samples[p][delta.index]
                sample.add(delta)
                index = p * self.n + delta.index
                first = index not in started
                started.add(index)
                text, logprobs = self._choice_parts(index, p, sample, delta.logprobs or (), first)
                if not (text or delta.text or delta.finish_reason or logprobs):
                    continue
                choice = CompletionChoice(
                    index=index,
                    text=text + delta.text,
                    logprobs=logprobs,
                    finish_reason=delta.finish_reason,
                    prompt_logprobs=self._prompt_entries(sample) if first else None,
                )
                yield chunk([choice])
            self._finish()
            if self.data.include_usage:
                yield chunk([], usage=self._usage())
            yield "[DONE]"
        except ApiError as exc:
            yield msgspec.json.encode(error_body(exc.error_type, exc.message)).decode()
        finally:
            slot.release()

    async def _deltas(self) -> AsyncIterator[tuple[int, object]]:
        """Every engine request's deltas as ``(prompt index, delta)``, as they come.

        Each request runs in its own task; leaving early (or an error) cancels them
        all, and each one's generator aborts its engine request as it closes.
        """
        if len(self.requests) == 1:
            async for delta in gen.generate(self.services, self.requests[0]):
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(p: int, request) -> None:
            try:
                async for delta in gen.generate(self.services, request):
                    queue.put_nowait((p, delta))
                queue.put_nowait((p, done))
            except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait((p, exc))

        tasks = [asyncio.create_task(pump(p, r)) for p, r in enumerate(self.requests)]
        try:
            remaining = len(tasks)
            while remaining:
                p, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield p, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
