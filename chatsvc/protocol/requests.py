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
# OpenAI's ranges: logprobs alternatives per token, penalties, logit biases.
MAX_LOGPROBS = 20
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 2.0
# A seen token's positive logit is divided by the penalty: below about 1e-37
# the quotient overflows fp32 to inf, and the max-subtraction before sampling
# turns inf - inf into NaN. At 0.01 a logit stays within 100x of itself, and a
# penalty that small already makes a seen token all but certain.
MIN_REPETITION_PENALTY = 0.01
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 300
# Beam search: widths as TensorRT-LLM's and vLLM's servers offer them. The length
# penalty is an exponent on the answer's length: past 4, a long answer's divisor
# leaves every score within rounding of 0 in fp32 (8,192 ** 4 is 4.5e15).
MAX_BEAM_WIDTH = 8
MAX_LENGTH_PENALTY = 4.0
EARLY_STOPPING = (True, False, "never")

FinishReason = Literal["stop", "length", "abort"]
CACHE_TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature < MIN_SAMPLING_TEMPERATURE`` (0 included) is greedy: argmax,
    ``top_k``, ``top_p`` and ``seed`` unused. ``top_k == 0`` and ``top_p == 1`` disable
    those filters. With ``seed`` set, sample ``i`` of ``n`` uses the seed
    ``seed + i``, so ``n`` samples equal ``n`` single runs with those seeds.

    Logit processing (``logits_processing``), each request on its own rows:
    ``logit_bias`` (token id, bias) pairs are added to the logits; before
    ``min_tokens`` output tokens the stop tokens are masked and stop strings are
    not searched; ``repetition_penalty`` (HF/vLLM: a seen token's positive logit
    divided by it, a negative one multiplied) covers prompt and output tokens;
    ``frequency_penalty`` (times the token's count) and ``presence_penalty``
    (once per seen token) are subtracted for output tokens (OpenAI's definition).
    Then temperature, ``top_k``, ``min_p`` (drop tokens below ``min_p`` times the
    top token's probability), ``top_p``. ``ignore_eos``: only ``stop_token_ids``
    and stop strings end the sample, not the model's end-of-sequence tokens.

    ``logprobs``: None = off, k = each output token's log-probability and the k
    most likely alternatives; ``prompt_logprobs`` likewise for every prompt token
    after the first. Both are the model's own distribution (log-softmax of the raw
    logits, before any processing, temperature or filter), as vLLM's default.
    A request with ``prompt_logprobs`` computes its whole prompt (the prefix cache
    is not read for it, only written), since a cached token has no logits.

    ``beam_width`` >= 2: beam search instead of sampling, with transformers'
    ``generate(num_beams=beam_width, do_sample=False)`` semantics
    (``chatsvc.engine.beam_search``): the ``n`` best finished beams come back, best
    first; ``length_penalty`` and ``early_stopping`` (True, False or "never") as
    there. It is deterministic, so the sampling fields must be neutral (temperature
    0, no top-p/top-k/min-p, penalties, bias, logprobs or stop strings); the stop
    tokens, ``ignore_eos``, ``min_tokens`` and ``max_tokens`` apply. 1 = off.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample ``index`` (None: drawn from the OS, not reproducible)."""
        return None if self.seed is None else self.seed + index

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise RequestValidationError (a ValueError) naming the first bad field; returns self.

        With ``vocab_size``, token ids (``logit_bias``, ``stop_token_ids``) must lie in it.
        """
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
        for token_id in self.stop_token_ids:
            if vocab_size is not None and token_id >= vocab_size:
                raise RequestValidationError(
                    f"stop_token_ids: {token_id} is not a token id of this model "
                    f"(vocabulary of {vocab_size})"
                )
        self._validate_processing(vocab_size)
        self._validate_logprobs()
        self._validate_beams()
        return self

    def _validate_processing(self, vocab_size: int | None) -> None:
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise RequestValidationError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if (
            not _is_number(self.repetition_penalty)
            or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise RequestValidationError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                f"{MAX_REPETITION_PENALTY}] (1 = off), "
                f"got {self.repetition_penalty!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise RequestValidationError(
                    f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value!r}"
                )
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise RequestValidationError(
                f"logit_bias must hold at most {MAX_LOGIT_BIAS_ENTRIES} token ids"
            )
        seen: set[int] = set()
        for entry in self.logit_bias:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise RequestValidationError("logit_bias must be (token id, bias) pairs")
            token_id, bias = entry
            if not _is_int(token_id) or token_id < 0 or token_id in seen:
                raise RequestValidationError(
                    f"logit_bias: {token_id!r} is not a token id (integers >= 0, each once)"
                )
            if vocab_size is not None and token_id >= vocab_size:
                raise RequestValidationError(
                    f"logit_bias: {token_id} is not a token id of this model "
                    f"(vocabulary of {vocab_size})"
                )
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise RequestValidationError(
                    f"logit_bias: the bias of token {token_id} must be in "
                    f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}"
                )
            seen.add(token_id)
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise RequestValidationError(
                f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
            )
        if self.min_tokens > self.max_tokens:
            raise RequestValidationError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not isinstance(self.ignore_eos, bool):
            raise RequestValidationError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise RequestValidationError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )

    def _validate_beams(self) -> None:
        if not _is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise RequestValidationError(
                f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}] (1 = no beam search), "
                f"got {self.beam_width!r}"
            )
        if not _is_number(self.length_penalty) or not (
            -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY
        ):
            raise RequestValidationError(
                f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                f"got {self.length_penalty!r}"
            )
        if not any(self.early_stopping is value for value in EARLY_STOPPING):
            raise RequestValidationError(
                f'early_stopping must be true, false or "never", got {self.early_stopping!r}'
            )
        if not self.is_beam_search:
            if self.length_penalty != 1.0 or self.early_stopping is not False:
                raise RequestValidationError(
                    "length_penalty and early_stopping apply to beam search only: "
                    "give beam_width >= 2"
                )
            return
        if self.n > self.beam_width:
            raise RequestValidationError(
                f"n ({self.n}) must not exceed beam_width ({self.beam_width}): "
                "beam search returns its n best beams"
            )
        # Beam search keeps the likeliest continuations: nothing is drawn, so none of
        # the sampling fields has a meaning, and a field that seems to work but does
        # not is worse than a refusal.
        conflicts = [
            (not self.is_greedy, "temperature must be 0"),
            (self.top_p != 1.0, "top_p must be 1"),
            (self.top_k != 0, "top_k must be 0 (off)"),
            (self.min_p != 0.0, "min_p must be 0"),
            (self.has_penalties, "it takes no repetition, frequency or presence penalty"),
            (bool(self.logit_bias), "it takes no logit_bias"),
            (self._wants_logprobs, "it returns no logprobs or prompt_logprobs"),
            (bool(self.stop), "it takes no stop strings (stop_token_ids work)"),
        ]
        for broken, rule in conflicts:
            if broken:
                raise RequestValidationError(f"beam search does not sample: {rule}")

    @property
    def _wants_logprobs(self) -> bool:
        return self.logprobs is not None or self.prompt_logprobs is not None


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
        self.sampling.validate(vocab_size)
        return self


@dataclass(frozen=True)
class RequestMetrics:
    """Per-sample figures, reported on the last delta of each sample index.

    ``cached_tokens_by_tier`` splits ``cached_prompt_tokens`` by where the blocks
    were found (CACHE_TIERS: "device", "host", "disk").
    """

    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    tpot_s: float
    latency_s: float
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability under the model, its rank, and the most likely tokens.

    ``rank`` 1 = the most likely token. ``top``: the k most likely ``(token id,
    logprob)``, best first (k = the request's ``logprobs`` / ``prompt_logprobs``).
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationDelta:
    """New output of sample ``index`` since its previous delta.

    ``logprobs``: one entry per token of ``token_ids`` when the request asked for them.
    ``prompt_logprobs``: on the first delta of each sample when asked for; one entry
    per prompt token, None for the first (nothing precedes it).
    """

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    metrics: RequestMetrics | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
