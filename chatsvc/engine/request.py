"""The request, delta and metrics types as the engine uses them.

Defined in ``chatsvc.protocol.requests`` (torch-free, so the API imports them
without the model code); this module names the same objects for engine code.
"""

from chatsvc.protocol.requests import (
    CACHE_TIERS,
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
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MIN_SAMPLING_TEMPERATURE",
    "FinishReason",
    "GenerationDelta",
    "GenerationRequest",
    "RequestMetrics",
    "SamplingParams",
    "TokenLogprob",
]
