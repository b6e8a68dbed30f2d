"""The inference engine: model loading, our own forward pass, scheduling and sampling.

The names below load on first use: importing ``chatsvc.engine`` (or a torch-free
module of it, such as ``chatsvc.engine.config``) does not import torch. Callers
outside the engine type against ``chatsvc.protocol`` (``EngineClient``) instead, and
the request, delta and error types are imported from there, by the engine too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatsvc.engine.async_engine import AsyncEngine
    from chatsvc.engine.config import EngineConfig
    from chatsvc.engine.engine import LLMEngine, StepOutput
    from chatsvc.engine.forward_batch import ForwardBatch
    from chatsvc.engine.llama import LlamaModel
    from chatsvc.engine.loader import LoadedModel, load_model
    from chatsvc.engine.model_config import ModelConfig, RopeScaling

# name -> the module that defines it
_EXPORTS = {
    "AsyncEngine": "chatsvc.engine.async_engine",
    "EngineConfig": "chatsvc.engine.config",
    "LLMEngine": "chatsvc.engine.engine",
    "StepOutput": "chatsvc.engine.engine",
    "ForwardBatch": "chatsvc.engine.forward_batch",
    "LlamaModel": "chatsvc.engine.llama",
    "LoadedModel": "chatsvc.engine.loader",
    "load_model": "chatsvc.engine.loader",
    "ModelConfig": "chatsvc.engine.model_config",
    "RopeScaling": "chatsvc.engine.model_config",
}

# Spelled out for static tools; the same names as _EXPORTS.
__all__ = [
    "AsyncEngine",
    "EngineConfig",
    "ForwardBatch",
    "LLMEngine",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "RopeScaling",
    "StepOutput",
    "load_model",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
