"""The inference engine: model loading, our own forward pass, scheduling and sampling."""

from chatsvc.engine.forward_batch import ForwardBatch
from chatsvc.engine.llama import LlamaModel
from chatsvc.engine.loader import LoadedModel, load_model
from chatsvc.engine.model_config import ModelConfig, RopeScaling

__all__ = [
    "ForwardBatch",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "RopeScaling",
    "load_model",
]
