"""What a caller hands the engine and what it gets back (fixed by docs/contracts.md).

Plain data, no torch: the API builds these and reads them without loading the model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from chatsvc.protocol.errors import RequestValidationError
from chatsvc.token_ids import first_bad_token_id

if TYPE_CHECKING:
    from cache import Namespace

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Temperatures below this sample greedily. Dividing logits by a smaller value
# overflows fp32 (1e-40 is subnormal, 1e-46 rounds to zero), and the
# distribution is one-hot to within rounding long before: vLLM draws the line
# at the same value.
MIN_SAMPLING_TEMPERATURE = 1e-5

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature < MIN_SAMPLING_TEMPERATURE`` (0 included) is greedy: argmax,
    ``top_k``, ``top_p`` and ``seed`` unused. ``top_k == 0`` and ``top_p == 1`` disable
    those filters. With ``seed`` set, sample ``i`` of ``n`` uses the seed
    ``seed + i``, so ``n`` samples equal ``n`` single runs with those seeds.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample ``index`` (None: drawn from the OS, not reproducible)."""
        return None if self.seed is None else self.seed + index

    def validate(self) -> SamplingParams:
        """Raise RequestValidationError (a ValueError) naming the first bad field; returns self."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestValidationError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not _is_number(self.temperature) or not 0.0 <= self.temperature < float("inf"):
            raise RequestValidationError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestValidationError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RequestValidationError(
                f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"
            )
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63 - MAX_N):
            raise RequestValidationError(
                f"seed must be an integer in [0, 2**63 - {MAX_N}), got {self.seed!r}"
            )
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise RequestValidationError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS:
            raise RequestValidationError(
                f"stop must be a tuple of at most {MAX_STOP_STRINGS} strings"
            )
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise RequestValidationError(
                    f"stop strings must be non-empty strings, got {text!r}"
                )
            if len(text) > MAX_STOP_STRING_CHARS:
                raise RequestValidationError(
                    f"a stop string is longer than {MAX_STOP_STRING_CHARS} chars"
                )
        if (
            not isinstance(self.stop_token_ids, tuple)
            or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
        ):
            raise RequestValidationError(
                f"stop_token_ids must be a tuple of at most {MAX_STOP_TOKEN_IDS} ids"
            )
        bad = first_bad_token_id(self.stop_token_ids)
        if bad is not None:
            raise RequestValidationError(f"stop token ids must be integers >= 0, got {bad.value!r}")
        return self


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete; ``labels`` only tag statistics (tenant, system prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    namespace: Namespace
    labels: dict[str, str] = field(default_factory=dict)

    def validate(self, vocab_size: int | None = None) -> GenerationRequest:
        """Raise RequestValidationError (a ValueError) on an empty id or prompt, token ids
        outside the vocabulary, or bad sampling values."""
        if not isinstance(self.request_id, str) or not self.request_id:
            raise RequestValidationError("request_id must be a non-empty string")
        if not self.prompt_token_ids:
            raise RequestValidationError(f"request {self.request_id!r}: the prompt has no tokens")
        limit = vocab_size if vocab_size is not None else 2**31
        bad = first_bad_token_id(self.prompt_token_ids, limit)
        if bad is not None:
            raise RequestValidationError(
                f"request {self.request_id!r}: token id {bad.value!r} is outside [0, {limit})"
            )
        self.sampling.validate()
        return self


@dataclass(frozen=True)
class RequestMetrics:
    """Per-sample figures, reported on the last delta of each sample index."""

    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    tpot_s: float
    latency_s: float


@dataclass(frozen=True)
class GenerationDelta:
    """New output of sample ``index`` since its previous delta."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    metrics: RequestMetrics | None = None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
