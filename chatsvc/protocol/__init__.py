"""The engine's contract, importable without torch: what callers hand the engine,
what they get back, the errors it raises and the calls they may make on it.

    from chatsvc.protocol import EngineClient, GenerationRequest, SamplingParams

``chatsvc.engine`` implements it (``AsyncEngine`` satisfies ``EngineClient``);
``chatsvc.api`` and ``chatsvc.service`` depend on this package only.
"""

from chatsvc.protocol.client import (
    ChatTemplate,
    EngineClient,
    EngineInfo,
    SamplingDefaults,
    Tokenizer,
)
from chatsvc.protocol.errors import (
    EngineError,
    EngineInternalError,
    EngineStoppedError,
    RequestTooLargeError,
    RequestValidationError,
)
from chatsvc.protocol.requests import (
    CACHE_TIERS,
    MAX_BEAM_WIDTH,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_SAMPLING_TEMPERATURE,
    FinishReason,
    GenerationDelta,
    GenerationRequest,
    RequestMetrics,
    SamplingParams,
    TokenLogprob,
)

__all__ = [
    "CACHE_TIERS",
    "MAX_BEAM_WIDTH",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MIN_SAMPLING_TEMPERATURE",
    "ChatTemplate",
    "EngineClient",
    "EngineError",
    "EngineInfo",
    "EngineInternalError",
    "EngineStoppedError",
    "FinishReason",
    "GenerationDelta",
    "GenerationRequest",
    "RequestMetrics",
    "RequestTooLargeError",
    "RequestValidationError",
    "SamplingDefaults",
    "SamplingParams",
    "TokenLogprob",
    "Tokenizer",
]
