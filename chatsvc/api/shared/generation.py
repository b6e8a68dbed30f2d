"""One generation on the engine: its slot, its deltas, what each sample produced, its figures.

Shared by the turn (``chatsvc.api.turn``) and the stateless OpenAI endpoints;
the engine's errors become API errors here, in one place.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from chatsvc.api.shared.errors import (
    ContextLengthError,
    InternalServerError,
    InvalidRequestError,
    RateLimitError,
    ServiceUnavailableError,
)
from chatsvc.protocol import (
    EngineInternalError,
    EngineStoppedError,
    GenerationDelta,
    GenerationRequest,
    RequestMetrics,
    RequestTooLargeError,
    RequestValidationError,
    TokenLogprob,
)
from chatsvc.service import Services

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
