"""The errors the engine raises to its callers.

Defined in ``chatsvc.protocol.errors`` (torch-free, part of the engine's
contract); this module names the same classes for engine code.
"""

from chatsvc.protocol.errors import (
    EngineError,
    EngineInternalError,
    EngineStoppedError,
    RequestTooLargeError,
    RequestValidationError,
)

__all__ = [
    "EngineError",
    "EngineInternalError",
    "EngineStoppedError",
    "RequestTooLargeError",
    "RequestValidationError",
]
