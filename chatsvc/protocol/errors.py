"""Errors the engine raises to its callers.

Two meanings a caller must keep apart: ``RequestValidationError`` (and its
subclass ``RequestTooLargeError``) says the request itself is bad, and its
message is written for the client; ``EngineInternalError`` says a step failed
while computing this request, and its message and cause are for the log only.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of the engine's own errors."""


class RequestValidationError(EngineError, ValueError):
    """The request is bad (a field out of range, an empty prompt, a duplicate id,
    a conversation the chat format refuses).

    Raised before the engine keeps any state of the request; the message names
    the field and is safe to show to the client.
    """


class RequestTooLargeError(RequestValidationError):
    """The request can never run: longer than the model's context or the whole KV pool."""


class EngineInternalError(EngineError, RuntimeError):
    """A step failed for this request alone (non-finite logits, a sampling or
    detokenizer error, a model step that refuses it); the request is ended and
    its blocks are freed, every other request goes on.

    The message and ``__cause__`` carry the detail for the log, not for the client.
    """


class EngineStoppedError(EngineError, RuntimeError):
    """The engine is not running (never started, stopped, or its thread died)."""
