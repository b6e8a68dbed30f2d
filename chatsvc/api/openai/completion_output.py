"""The output side of ``POST /v1/completions``: engine deltas into choices and chunks.

Each prompt of a request is its own engine request; their deltas are merged as they
come (``deltas``), folded into per-sample results, and turned into OpenAI's
``text_completion`` objects: choice ``prompt_index * n + i``, the echoed prompt and
its scores in front of a choice's first piece, ``text_offset`` running on across a
stream's chunks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec

from chatsvc.api.openai.completion_schemas import Completion, CompletionChoice, CompletionRequest
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

    def __init__(self, services, data: CompletionRequest, prompts: list, requests):
        """``prompts[i]`` (a ``completions.Prompt``) was sent as ``requests[i]``."""
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

    async def chunks(self, slot: StreamSlot) -> AsyncIterator[str]:
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
