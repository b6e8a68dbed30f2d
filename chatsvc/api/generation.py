"""Steps shared by the native and the OpenAI-compatible endpoints.

Everything here that can fail on bad input runs before the engine or Redis is
touched, so a rejected request leaves no state behind.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio
from jinja2 import TemplateError

from cache import Namespace
from chatsvc.api.errors import (
    ContextLengthError,
    InternalServerError,
    InvalidRequestError,
    RateLimitError,
    ServiceUnavailableError,
)
from chatsvc.protocol import (
    ChatTemplate,
    EngineInternalError,
    EngineStoppedError,
    GenerationDelta,
    GenerationRequest,
    RequestMetrics,
    RequestTooLargeError,
    RequestValidationError,
    SamplingParams,
    TokenLogprob,
)
from chatsvc.service import Services
from chatsvc.store.records import SystemPromptRecord, TenantRecord

T = TypeVar("T")
log = logging.getLogger(__name__)
ENGINE_FAILED = "the engine failed while generating this answer"


@dataclass
class SampleResult:
    """What one sample (index) produced by the end of its generation."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    def add(self, delta: GenerationDelta) -> None:
        """Take in one delta of this sample."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.metrics = delta.metrics

    @property
    def finished(self) -> bool:
        """Ended with its final figures, and not by an abort."""
        return self.finish_reason not in (None, "abort") and self.metrics is not None


def build_sampling(
    services: Services,
    *,
    max_tokens: int | None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: list[str] = (),
    n: int = 1,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    **options: Any,
) -> tuple[SamplingParams, int | None]:
    """SamplingParams from request fields, with the service's caps; 400 on bad values.

    A sampling field given as None takes the served model's default
    (``engine.sampling_defaults``: its generation config, else the built-in one).
    ``options``: further SamplingParams fields (penalties, logit_bias, min_tokens,
    ignore_eos, stop_token_ids, logprobs, prompt_logprobs). ``max_tokens`` stays None
    here when not given: it is resolved against the prompt's length by ``fit_context``.
    """
    defaults = services.engine.sampling_defaults
    limits = services.settings.limits
    if max_tokens is not None and max_tokens > limits.max_tokens_cap:
        raise InvalidRequestError(
            f"max_tokens {max_tokens} exceeds this server's cap of {limits.max_tokens_cap}"
        )
    if n > limits.max_n:
        raise InvalidRequestError(f"n {n} exceeds this server's cap of {limits.max_n}")
    # Until fit_context sizes an absent max_tokens, any value min_tokens allows.
    placeholder = max(1, options.get("min_tokens") or 0)
    try:
        params = SamplingParams(
            max_tokens=placeholder if max_tokens is None else max_tokens,
            temperature=defaults.temperature if temperature is None else temperature,
            top_p=defaults.top_p if top_p is None else top_p,
            top_k=defaults.top_k if top_k is None else top_k,
            seed=seed,
            stop=tuple(stop),
            n=n,
            min_p=defaults.min_p if min_p is None else min_p,
            repetition_penalty=(
                defaults.repetition_penalty if repetition_penalty is None else repetition_penalty
            ),
            **options,
        ).validate(services.engine.vocab_size)
    except (RequestValidationError, TypeError) as exc:
        raise InvalidRequestError(str(exc)) from None
    return params, max_tokens


def fit_context(
    services: Services,
    prompt_len: int,
    sampling: SamplingParams,
    requested: int | None,
    default_max_tokens: int | None = None,
) -> SamplingParams:
    """Return sampling with max_tokens fitted to the model's context; 400 if it cannot fit.

    An explicit max_tokens that overflows the context is an error (as in
    OpenAI's API) rather than a silent truncation; an absent one takes the
    room that is left, up to the server's cap (and ``default_max_tokens``).
    """
    limit = services.engine.max_context_len
    room = limit - prompt_len
    if room < 1:
        raise ContextLengthError(
            f"the prompt has {prompt_len} tokens; this model's context is {limit} tokens"
        )
    if requested is None:
        fitted = min(room, services.settings.limits.max_tokens_cap, default_max_tokens or room)
        if sampling.min_tokens > fitted:
            raise InvalidRequestError(
                f"min_tokens ({sampling.min_tokens}) exceeds the {fitted} tokens this request "
                "may generate; give max_tokens, or fewer min_tokens"
            )
        return replace(sampling, max_tokens=fitted)
    if requested > room:
        raise ContextLengthError(
            f"prompt ({prompt_len} tokens) plus max_tokens ({requested}) exceeds this "
            f"model's context of {limit} tokens"
        )
    return sampling


def check_text(text: str, services: Services, what: str = "message") -> str:
    if not any(c.isprintable() and not c.isspace() for c in text):
        raise InvalidRequestError(f"the {what} is empty (no visible character)")
    limit = services.settings.limits.max_message_chars
    if len(text) > limit:
        raise InvalidRequestError(f"the {what} has {len(text)} characters; the limit is {limit}")
    return text


def shared_prefix_len(prompt: list[int], system_prompt: SystemPromptRecord | None) -> int:
    """Leading prompt tokens that belong to a *shared* system prompt (0 = all private).

    Only the exact tokens stored with the shared prompt count, and only when
    the prompt really starts with them; the first token after them (the user's
    text) is private, so the tenant's salt covers every block holding it.
    """
    if system_prompt is None or not system_prompt.shared or not system_prompt.token_ids:
        return 0
    n = len(system_prompt.token_ids)
    return n if prompt[:n] == system_prompt.token_ids else 0


async def format_chat(call: Callable[..., T], *args: Any) -> T:
    """Run a ChatFormat call (template rendering, tokenization) in a worker thread.

    A large conversation takes long to render and tokenize; on the event loop
    that would stall every other request and the turn locks' renewals. The
    engine thread is not used: it is reserved for the model. A conversation the
    chat format or the template refuses is a 400; any other failure is ours (500).
    """
    try:
        return await anyio.to_thread.run_sync(functools.partial(call, *args))
    except RequestValidationError as exc:
        raise InvalidRequestError(str(exc)) from None
    except TemplateError as exc:
        raise InvalidRequestError(f"the chat template refused the conversation: {exc}") from None


async def system_prefix_tokens(services: Services, text: str) -> list[int]:
    """The tokens a system prompt contributes to the front of every rendered conversation.

    Rendering the system message followed by two different user messages and
    keeping the common prefix gives exactly the tokens that do not depend on
    what follows, whatever the template and tokenizer do at the boundary.
    """
    return await format_chat(_system_prefix, services.engine.chat_format, text)


def _system_prefix(fmt: ChatTemplate, text: str) -> list[int]:
    a = fmt.render([{"role": "system", "content": text}, {"role": "user", "content": "a"}])
    b = fmt.render([{"role": "system", "content": text}, {"role": "user", "content": "Zq"}])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def namespace_for(tenant: TenantRecord, shared_len: int) -> Namespace:
    """The cache namespace of a tenant's prompt whose first ``shared_len`` tokens are public."""
    return Namespace(tenant_salt=tenant.cache_salt, shared_prefix_len=shared_len, label=tenant.id)


class StreamSlot:
    """One of the tenant's concurrent-generation slots; release is idempotent."""

    def __init__(self, services: Services, tenant_id: str) -> None:
        if not services.streams.try_acquire(tenant_id):
            raise RateLimitError(
                f"this tenant already runs {services.streams.limit} generations; retry later"
            )
        self._services = services
        self._tenant_id = tenant_id
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._services.streams.release(self._tenant_id)


def new_request_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


async def generate(
    services: Services, request: GenerationRequest
) -> AsyncIterator[GenerationDelta]:
    """The engine's deltas for ``request``; leaving early aborts it and frees its blocks.

    The engine's errors become API errors: a bad request -> 400 (too large for the
    context or the KV pool: context_length_exceeded); engine stopped or its thread
    died -> 503; a step that failed for this request, or anything else the engine
    raises -> 500 server_error with a generic message (the detail is logged, never
    sent: it may describe the engine's internals).
    """
    try:
        async with aclosing(services.engine.generate(request)) as deltas:
            async for delta in deltas:
                yield delta
    except RequestTooLargeError as exc:
        raise ContextLengthError(str(exc)) from None
    except RequestValidationError as exc:
        raise InvalidRequestError(str(exc)) from None
    except EngineStoppedError as exc:
        raise ServiceUnavailableError(f"the engine is not running: {exc}") from None
    except EngineInternalError as exc:
        # The engine logged the cause with its traceback; this line ties it to the
        # HTTP request's id.
        log.error("engine request %s failed: %s", request.request_id, exc)
        raise InternalServerError(ENGINE_FAILED) from None
    except Exception:  # noqa: BLE001 - an engine bug: logged, answered as a 500
        log.exception("engine request %s raised", request.request_id)
        raise InternalServerError(ENGINE_FAILED) from None


def record_finished(
    services: Services, endpoint: str, labels: dict[str, str], samples: list[SampleResult]
) -> None:
    """Feed a finished request's usage into the admin stats and the Prometheus metrics."""
    first = samples[0].metrics
    if first is None:
        return
    completion = sum(s.metrics.completion_tokens for s in samples if s.metrics is not None)
    services.usage.record(labels, first.prompt_tokens, first.cached_prompt_tokens)
    services.metrics.observe_request(
        endpoint,
        prompt_tokens=first.prompt_tokens,
        cached_tokens=first.cached_prompt_tokens,
        completion_tokens=completion,
        ttft_s=first.ttft_s,
        tpot_s=first.tpot_s,
        cached_by_tier=first.cached_tokens_by_tier,
    )
