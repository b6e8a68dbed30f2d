"""The inference engine: model loading, our own forward pass, scheduling and sampling."""

from chatsvc.engine.async_engine import AsyncEngine
from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine, StepOutput
from chatsvc.engine.errors import EngineError, EngineStoppedError, RequestTooLargeError
from chatsvc.engine.forward_batch import ForwardBatch
from chatsvc.engine.llama import LlamaModel
from chatsvc.engine.loader import LoadedModel, load_model
from chatsvc.engine.model_config import ModelConfig, RopeScaling
from chatsvc.engine.request import (
    GenerationDelta,
    GenerationRequest,
    RequestMetrics,
    SamplingParams,
)

__all__ = [
    "AsyncEngine",
    "EngineConfig",
    "EngineError",
    "EngineStoppedError",
    "GenerationDelta",
    "GenerationRequest",
    "LLMEngine",
    "RequestMetrics",
    "RequestTooLargeError",
    "SamplingParams",
    "StepOutput",
    "ForwardBatch",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "RopeScaling",
    "load_model",
]
