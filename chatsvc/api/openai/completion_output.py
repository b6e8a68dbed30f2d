"""The output side of ``POST /v1/completions``: engine deltas into choices and chunks.

Each prompt of a request is its own engine request; their deltas are merged as they
come (``deltas``), folded into per-sample results, and turned into OpenAI's
``text_completion`` objects: choice ``prompt_index * n + i``, the echoed prompt and
its scores in front of a choice's first piece, ``text_offset`` running on across a
stream's chunks.

A prompt's scores are the same on each of its n choices (the engine scores the prompt
once and its forks share it), so what they become is built once per prompt: the
``prompt_logprobs`` entries encoded once (a ``msgspec.Raw`` every choice carries), the
echoed prompt's ``logprobs`` once (each choice appends its own tokens to a copy).
A large answer is built in a worker thread (``response_size.off_loop``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec

from chatsvc.api.openai import response_size
from chatsvc.api.openai.completion_schemas import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
)
from chatsvc.api.openai.logprob_views import (
    CompletionLogprobsBuilder,
    prompt_logprob_dicts,
    token_texts,
)
from chatsvc.api.openai.schemas import CompletionUsage, PromptTokensDetails
from chatsvc.api.shared.errors import ApiError, ServiceUnavailableError, error_body
from chatsvc.api.shared.generation import (
    SampleResult,
    StreamSlot,
    generate,
    new_request_id,
    record_finished,
)

ENDPOINT = "completions"


class CompletionOutput:
    """One completions request's engine requests, and how their output becomes choices."""

    def __init__(self, services, data: CompletionRequest, prompts: list, requests, estimate: int):
        """``prompts[i]`` (a ``completions.Prompt``) was sent as ``requests[i]``; the
        answer is estimated at ``estimate`` bytes (``response_size``)."""
        self.services = services
        self.data = data
        self.prompts = prompts
        self.requests = requests
        self.n = requests[0].sampling.n
        self.id = new_request_id("cmpl")
        self.created = int(time.time())
        self.model = services.engine.model_name
        self.texts = token_texts(services.engine.tokenizer)
        self.wants_logprobs = data.logprobs is not None
        self.wants_prompt_logprobs = data.prompt_logprobs is not None
        self.samples = [[SampleResult() for _ in range(self.n)] for _ in prompts]
        self.builders = [
            CompletionLogprobsBuilder(self.texts) for _ in range(len(prompts) * self.n)
        ]
        self.estimate = estimate
        # Per prompt index, built by the first choice that needs it.
        self._prompt_fragments: dict[int, msgspec.Raw] = {}
        self._echo_logprobs: dict[int, tuple[CompletionLogprobs, int]] = {}

    def _echo_text(self, index: int) -> str:
        prompt = self.prompts[index]
        if prompt.text is not None:
            return prompt.text
        return self.services.engine.chat_format.decode(prompt.token_ids)

    async def collect(self) -> list[list[SampleResult]]:
        async for which, delta in self._deltas():
            self.samples[which][delta.index].add(delta)
        self._finish()
        return self.samples

    def _finish(self) -> None:
        for request, samples in zip(self.requests, self.samples, strict=True):
            if any(s.finish_reason in (None, "abort") for s in samples):
                self.services.metrics.observe_failure(ENDPOINT, "aborted")
                raise ServiceUnavailableError("the generation was aborted")
            record_finished(self.services, ENDPOINT, request.labels, samples)

    async def encoded_response(self, results: list[list[SampleResult]]) -> bytes:
        """The answer's JSON, built and encoded off the event loop when it is large."""
        return await response_size.off_loop(
            lambda: response_size.encode_answer(self.response(results)), self.estimate
        )

    def response(self, results: list[list[SampleResult]]) -> Completion:
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
                        prompt_logprobs=self._prompt_entries(p, sample),
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
        if not (echo and sample.prompt_logprobs is not None):
            return echo, builder.build(scores)
        prompt, end = self._echo_prefix(p, sample.prompt_logprobs)
        builder.offset = end
        own = builder.build(scores)
        return echo, CompletionLogprobs(
            tokens=prompt.tokens + own.tokens,
            token_logprobs=prompt.token_logprobs + own.token_logprobs,
            top_logprobs=prompt.top_logprobs + own.top_logprobs,
            text_offset=prompt.text_offset + own.text_offset,
        )

    def _echo_prefix(self, p: int, scores) -> tuple[CompletionLogprobs, int]:
        """Prompt p's echoed ``logprobs``, and the text offset its choices go on from."""
        if p not in self._echo_logprobs:
            builder = CompletionLogprobsBuilder(self.texts)
            built = builder.build(scores, self.prompts[p].token_ids)
            self._echo_logprobs[p] = built, builder.offset
        return self._echo_logprobs[p]

    def _prompt_entries(self, p: int, sample) -> msgspec.Raw | None:
        """Prompt p's ``prompt_logprobs``, encoded once for all its choices."""
        if not self.wants_prompt_logprobs or sample.prompt_logprobs is None:
            return None
        if p not in self._prompt_fragments:
            entries = prompt_logprob_dicts(self.texts, sample.prompt_logprobs)
            self._prompt_fragments[p] = msgspec.Raw(msgspec.json.encode(entries))
        return self._prompt_fragments[p]

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

    def _chunk(self, choices: list[CompletionChoice], usage: CompletionUsage | None = None) -> str:
        body = Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )
        return response_size.encode_answer(body).decode()

    def _delta_chunk(self, p: int, delta, first: bool) -> str | None:
        """The chunk of one delta of prompt p (None: it carries nothing to send)."""
        sample = self.samples[p][delta.index]
        index = p * self.n + delta.index
        text, logprobs = self._choice_parts(index, p, sample, delta.logprobs or (), first)
        if not (text or delta.text or delta.finish_reason or logprobs):
            return None
        choice = CompletionChoice(
            index=index,
            text=text + delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            prompt_logprobs=self._prompt_entries(p, sample) if first else None,
        )
        return self._chunk([choice])

    async def chunks(self, slot: StreamSlot) -> AsyncIterator[str]:
        started: set[int] = set()
        try:
            async for p, delta in self._deltas():
                self.samples[p][delta.index].add(delta)
                index = p * self.n + delta.index
                first = index not in started
                started.add(index)
                # Only a choice's first chunk carries its prompt's scores (the weight).
                chunk = await response_size.off_loop(
                    lambda p=p, delta=delta, first=first: self._delta_chunk(p, delta, first),
                    self.estimate if first else 0,
                )
                if chunk is not None:
                    yield chunk
            self._finish()
            if self.data.include_usage:
                yield self._chunk([], usage=self._usage())
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
            async for delta in generate(self.services, self.requests[0]):
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(p: int, request) -> None:
            try:
                async for delta in generate(self.services, request):
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
